// Template: a parsed Jinja template rendered the way transformers' apply_chat_template renders
// chat templates with Python jinja2 (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
// loopcontrols, transformers' tojson/raise_exception/strftime_now/namespace/dict globals).
// Called by text::ChatTemplate (and tests). Invariant: a Template is immutable after parse, so
// one instance may be rendered from many threads at once; every syntax or runtime error comes
// back as an Error whose message reads "<name>: line L, column C: <what>".
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/jinja/ast.h"
#include "text/jinja/value.h"

namespace m3::text::jinja {

// Limits that keep a hostile or buggy template from hanging or exhausting memory. The defaults
// are far above what real chat templates need (a 1M-token prompt renders in well under 1e7 steps).
struct RenderOptions {
  size_t max_output_bytes = size_t{512} << 20;  // rendered text and any single string value
  uint64_t max_steps = 200'000'000;             // evaluated nodes + loop iterations
  int max_depth = 400;                          // nested evaluation frames (macro recursion)
  // strftime_now(format) global; empty -> local time via std::strftime. Tests inject a clock.
  std::function<std::string(const std::string& format)> strftime_now;
};

class Template {
 public:
  // Parse `source`; `name` prefixes error messages (e.g. a file path or "chat template").
  static Result<Template> parse(std::string_view source, std::string name = "template");

  // Render with top-level variables `vars` (must be a dict Value / JSON object).
  Result<std::string> render(const Value& vars, const RenderOptions& options = {}) const;
  Result<std::string> render(const nlohmann::ordered_json& vars,
                             const RenderOptions& options = {}) const;

  const std::string& name() const { return name_; }

 private:
  std::shared_ptr<const std::vector<NodePtr>> body_;
  std::string name_;
};

}  // namespace m3::text::jinja
