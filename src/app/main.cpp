// m3serve: the command-line entry point. Subcommands live in cmd_*.cpp (see commands.h).
// vLLM's spellings are rewritten first (app/vllm_flags.h: `--max_model_len`, dotted config keys,
// `-tp`), and a repeated option takes its last value, as argparse does.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "app/commands.h"
#include "app/vllm_flags.h"

namespace m3::app {

int fail(const std::string& message, int code) {
  std::fprintf(stderr, "m3serve: error: %s\n", message.c_str());
  return code;
}

}  // namespace m3::app

int main(int argc, char** argv) {
  CLI::App app{"m3serve: a native serving engine for the MiniMax-M3 model family", "m3serve"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("m3serve ") + M3_VERSION);
  // Inherited by every subcommand's options (vector options opt back into TakeAll).
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  std::map<std::string, m3::app::RunFn> runs;
  runs["generate"] = m3::app::register_generate(app);
  runs["tokenize"] = m3::app::register_tokenize(app);
  runs["detokenize"] = m3::app::register_detokenize(app);
  runs["serve"] = m3::app::register_serve(app);
  runs["chat"] = m3::app::register_chat(app);
  runs["plan"] = m3::app::register_plan(app);
  runs["process-image"] = m3::app::register_image(app);
  runs["parse-outputs"] = m3::app::register_parse(app);
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  args = m3::app::normalize_vllm_argv(args);
  std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 pops from the back
  try {
    app.parse(reversed);
  } catch (const CLI::ExtrasError& e) {
    std::string sub = "m3serve";
    for (auto* s : app.get_subcommands()) sub += " " + s->get_name();
    // CLI11 says "The following argument(s) was/were not expected: X"; keep only X.
    std::string what = e.what();
    if (const size_t colon = what.find(": "); colon != std::string::npos) what.erase(0, colon + 2);
    return m3::app::fail(what + ": not a flag of `" + sub +
                             "` (neither m3serve's nor a vLLM flag " + "it knows); `" + sub +
                             " --help` lists them, vLLM's included",
                         e.get_exit_code());
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  for (auto* sub : app.get_subcommands()) {
    auto it = runs.find(sub->get_name());
    if (it != runs.end()) return it->second();
  }
  return m3::app::fail("no subcommand given; see m3serve --help");
}
