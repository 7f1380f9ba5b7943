// Jinja renderer against jinja2 goldens (feature templates and error cases) plus direct checks
// of behaviour the goldens cannot show (line/column in messages, limits, strftime_now).
#include <gtest/gtest.h>

#include "text/jinja/template.h"
#include "unit/text/jinja/golden_util.h"

namespace m3::text::jinja {
namespace {

using test::goldens;

Result<std::string> render(std::string_view src,
                           const nlohmann::ordered_json& vars = nlohmann::ordered_json::object(),
                           const RenderOptions& opts = {}) {
  M3_TRY(auto t, Template::parse(src, "t"));
  return t.render(vars, opts);
}

TEST(JinjaGolden, GoldensWereMadeByJinja2) {
  EXPECT_FALSE(goldens().at("jinja2_version").get<std::string>().empty());
  EXPECT_GE(goldens().at("features").size(), 50u);
  EXPECT_GE(goldens().at("errors").size(), 20u);
}

TEST(JinjaGolden, FeatureTemplatesRenderLikeJinja2) {
  for (const auto& c : goldens().at("features")) {
    SCOPED_TRACE(c.at("name").get<std::string>());
    auto out = render(c.at("template").get<std::string>(), c.at("vars"));
    ASSERT_TRUE(out) << out.error().message;
    EXPECT_EQ(*out, c.at("expected").get<std::string>());
  }
}

TEST(JinjaGolden, ErrorCasesFailOnJinja2sLine) {
  for (const auto& c : goldens().at("errors")) {
    SCOPED_TRACE(c.at("name").get<std::string>() + ": jinja2 says " +
                 c.at("message").get<std::string>());
    auto out = render(c.at("template").get<std::string>(), c.at("vars"));
    ASSERT_FALSE(out) << "rendered: " << *out;
    const std::string& msg = out.error().message;
    EXPECT_EQ(msg.rfind("t: line ", 0), 0u) << msg;
    EXPECT_NE(msg.find(", column "), std::string::npos) << msg;
    if (!c.at("line").is_null()) {
      EXPECT_NE(msg.find("line " + std::to_string(c.at("line").get<int>()) + ","),
                std::string::npos)
          << msg;
    }
  }
}

TEST(Jinja, SyntaxErrorNamesLineAndColumn) {
  auto out = render("ok\n  {{ 1 + }}");
  ASSERT_FALSE(out);
  EXPECT_EQ(out.error().message,
            "t: line 2, column 10: unexpected end of print statement '}}', expected an expression");
  auto unknown = render("a\n\n   {% frob %}");
  ASSERT_FALSE(unknown);
  EXPECT_EQ(
      unknown.error().message.rfind("t: line 3, column 7: unknown or unsupported tag 'frob'", 0),
      0u)
      << unknown.error().message;
}

TEST(Jinja, RuntimeErrorNamesLineAndColumn) {
  auto out = render("{% for m in ms %}\n  {{ m.a.b }}\n{% endfor %}", {{"ms", {{{"x", 1}}}}});
  ASSERT_FALSE(out);
  EXPECT_EQ(out.error().message, "t: line 2, column 9: 'dict object' has no attribute 'a'");
  auto raised = render("\n{{ raise_exception('bad roles') }}");
  ASSERT_FALSE(raised);
  EXPECT_EQ(raised.error().message, "t: line 2, column 4: bad roles");
}

TEST(Jinja, StrftimeNowUsesInjectedClock) {
  RenderOptions opts;
  opts.strftime_now = [](const std::string& fmt) { return "[" + fmt + "]"; };
  auto out =
      render("Today is {{ strftime_now('%d %b %Y') }}.", nlohmann::ordered_json::object(), opts);
  ASSERT_TRUE(out) << out.error().message;
  EXPECT_EQ(*out, "Today is [%d %b %Y].");
  auto real = render("{{ strftime_now('%Y') | length }}");
  ASSERT_TRUE(real) << real.error().message;
  EXPECT_EQ(*real, "4");
}

TEST(Jinja, LimitsStopRunawayTemplates) {
  RenderOptions opts;
  opts.max_steps = 100000;
  opts.max_output_bytes = 1 << 20;
  auto loop =
      render("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
             nlohmann::ordered_json::object(), opts);
  ASSERT_FALSE(loop);
  EXPECT_NE(loop.error().message.find("evaluation budget"), std::string::npos)
      << loop.error().message;
  auto big = render("{{ 'abc' * 100000000 }}", nlohmann::ordered_json::object(), opts);
  ASSERT_FALSE(big);
  EXPECT_NE(big.error().message.find("exceeds the limit"), std::string::npos)
      << big.error().message;
  // Default options: unbounded recursion must end in an error, not a stack overflow.
  auto rec = render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
  ASSERT_FALSE(rec);
  EXPECT_NE(rec.error().message.find("recursion is too deep"), std::string::npos)
      << rec.error().message;
  auto nested = render("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}");
  ASSERT_FALSE(nested);
  EXPECT_NE(nested.error().message.find("nesting is too deep"), std::string::npos)
      << nested.error().message;
  std::string blocks;
  for (int i = 0; i < 3000; ++i) blocks += "{% if true %}";
  auto deep_blocks = render(blocks);
  ASSERT_FALSE(deep_blocks);
  EXPECT_NE(deep_blocks.error().message.find("nesting is too deep"), std::string::npos)
      << deep_blocks.error().message;
}

TEST(Jinja, TemplateIsReusableAndVariablesAreNotMutated) {
  auto t = Template::parse(
      "{% set ns = namespace(n=0) %}{% for x in xs %}{% set ns.n = ns.n + x %}{% endfor %}{{ ns.n "
      "}}");
  ASSERT_TRUE(t) << t.error().message;
  Value vars = from_json({{"xs", {1, 2, 3}}});
  for (int i = 0; i < 3; ++i) {
    auto out = t->render(vars);
    ASSERT_TRUE(out) << out.error().message;
    EXPECT_EQ(*out, "6");
  }
  EXPECT_EQ(to_json(vars).dump(), R"({"xs":[1,2,3]})");
}

TEST(Jinja, FloatReprMatchesPython) {
  EXPECT_EQ(format_float(1.0), "1.0");
  EXPECT_EQ(format_float(0.1), "0.1");
  EXPECT_EQ(format_float(1e16), "1e+16");
  EXPECT_EQ(format_float(1e15), "1000000000000000.0");
  EXPECT_EQ(format_float(0.0001), "0.0001");
  EXPECT_EQ(format_float(0.00001), "1e-05");
  EXPECT_EQ(format_float(-2.5e-7), "-2.5e-07");
  EXPECT_EQ(format_float(123456789.125), "123456789.125");
  EXPECT_EQ(format_float(-0.0), "-0.0");
}

}  // namespace
}  // namespace m3::text::jinja
