// Template::parse: lexer + parser. Rendering lives in interpreter.cpp.
#include "text/jinja/template.h"

#include "text/jinja/lexer.h"
#include "text/jinja/parser.h"

namespace m3::text::jinja {

Result<Template> Template::parse(std::string_view source, std::string name) {
  M3_TRY(auto tokens, tokenize(source, name));
  M3_TRY(auto body, parse_template(std::move(tokens), name));
  Template t;
  t.body_ = std::make_shared<const std::vector<NodePtr>>(std::move(body));
  t.name_ = std::move(name);
  return t;
}

Result<std::string> Template::render(const nlohmann::ordered_json& vars,
                                     const RenderOptions& options) const {
  if (!vars.is_object())
    return make_error(ErrorCode::kInvalidArgument,
                      name_ + ": template variables must be a JSON object");
  Value v;
  try {
    v = from_json(vars);
  } catch (const RenderError& e) {
    return make_error(ErrorCode::kInvalidArgument, name_ + ": " + e.what());
  }
  return render(v, options);
}

}  // namespace m3::text::jinja
