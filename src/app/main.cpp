// m3serve: the command-line entry point. Subcommands live in cmd_*.cpp (see commands.h).
#include <CLI/CLI.hpp>

#include <cstdio>
#include <map>
#include <string>

#include "app/commands.h"

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
  std::map<std::string, m3::app::RunFn> runs;
  runs["generate"] = m3::app::register_generate(app);
  runs["tokenize"] = m3::app::register_tokenize(app);
  runs["detokenize"] = m3::app::register_detokenize(app);
  runs["serve"] = m3::app::register_serve(app);
  runs["chat"] = m3::app::register_chat(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  for (auto* sub : app.get_subcommands()) {
    auto it = runs.find(sub->get_name());
    if (it != runs.end()) return it->second();
  }
  return m3::app::fail("no subcommand given; see m3serve --help");
}
