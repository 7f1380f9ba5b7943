// The `m3serve` subcommands. Each cmd_*.cpp registers one subcommand on the CLI11 app and runs
// it; main.cpp only wires them. A subcommand reports failure as one clear line on stderr and a
// non-zero exit code, never a crash.
#pragma once

#include <functional>
#include <string>

namespace CLI {
class App;
}

namespace m3::app {

// Registers the subcommand and returns the function that runs it (returns the exit code).
using RunFn = std::function<int()>;
RunFn register_generate(CLI::App& app);
RunFn register_tokenize(CLI::App& app);
RunFn register_detokenize(CLI::App& app);
RunFn register_serve(CLI::App& app);
RunFn register_chat(CLI::App& app);
RunFn register_plan(CLI::App& app);
RunFn register_image(CLI::App& app);
RunFn register_parse(CLI::App& app);

// The embedded demo model directory (<repo>/models/demo, or $M3SERVE_MODELS_DIR/demo), or "".
std::string find_demo_model();

// Prints "m3serve: error: <message>" to stderr and returns 1 (or `code`).
int fail(const std::string& message, int code = 1);

}  // namespace m3::app
