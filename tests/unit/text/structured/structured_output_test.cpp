// text::StructuredOutputCompiler with the demo model's tokenizer: valid outputs (JSON schema,
// any JSON object, regex, choice, EBNF, the M3 tool-call block, each after an optional reasoning
// block) are accepted token by token and then allow only EOS, which terminates the matcher;
// invalid continuations are rejected and absent from the allowed set; invalid schemas, regexes
// and grammars are kInvalidArgument errors naming the request field; compiles are cached.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "text/structured_output.h"
#include "text/tokenizer.h"

namespace m3::text {
namespace {

using Kind = StructuredOutputSpec::Kind;

constexpr int32_t kEos = 2636;  // models/demo: eos_token_id
constexpr int64_t kModelVocab = 2688;

class Structured : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!StructuredOutputCompiler::available()) GTEST_SKIP() << "built without xgrammar";
    auto t = Tokenizer::from_file(std::string(M3_SOURCE_DIR) + "/models/demo/tokenizer.json");
    ASSERT_TRUE(t.has_value()) << t.error().message;
    tok_ = *t;
    compiler_ =
        std::make_unique<StructuredOutputCompiler>(tok_, kModelVocab, std::vector<int32_t>{kEos});
  }

  std::shared_ptr<const CompiledStructure> compile(StructuredOutputSpec s,
                                                   ReasoningPrefix p = ReasoningPrefix::kNone) {
    if (s.param.empty()) s.param = "response_format";
    auto c = compiler_->compile(s, p);
    EXPECT_TRUE(c.has_value()) << (c ? "" : c.error().message);
    return c ? *c : nullptr;
  }

  static bool allowed(TokenMatcher& m, int32_t t) {
    std::vector<uint32_t> bits((kModelVocab + 31) / 32, 0u);
    m.fill_allowed(bits);
    return (bits[t / 32] >> (t % 32)) & 1u;
  }

  // Feeds `text`'s tokens; returns how many were accepted before the first rejection. Each one
  // must also have been in the allowed set.
  size_t feed(TokenMatcher& m, const std::string& text) {
    const auto ids = tok_->encode(text);
    for (size_t i = 0; i < ids.size(); ++i) {
      const bool in_mask = allowed(m, ids[i]);
      const bool ok = m.accept(ids[i]);
      EXPECT_EQ(in_mask, ok) << "token " << i << " of " << text;
      if (!ok) return i;
    }
    return ids.size();
  }

  // The whole text is accepted, then only EOS is allowed and it terminates the matcher.
  void expect_complete(const CompiledStructure& c, const std::string& text) {
    auto m = c.make_matcher();
    ASSERT_EQ(feed(*m, text), tok_->encode(text).size()) << text;
    std::vector<uint32_t> bits((kModelVocab + 31) / 32, 0u);
    m->fill_allowed(bits);
    EXPECT_TRUE((bits[kEos / 32] >> (kEos % 32)) & 1u) << text;
    EXPECT_FALSE(m->is_terminated());
    EXPECT_TRUE(m->accept(kEos));
    EXPECT_TRUE(m->is_terminated());
  }

  void expect_rejected(const CompiledStructure& c, const std::string& text) {
    auto m = c.make_matcher();
    EXPECT_LT(feed(*m, text), tok_->encode(text).size()) << text;
  }

  std::shared_ptr<const Tokenizer> tok_;
  std::unique_ptr<StructuredOutputCompiler> compiler_;
};

const char* kPersonSchema = R"({"type": "object", "properties": {"name": {"type": "string"},
  "age": {"type": "integer", "minimum": 0}}, "required": ["name", "age"],
  "additionalProperties": false})";

TEST_F(Structured, JsonSchemaAcceptsValidAndRejectsInvalid) {
  auto c = compile({Kind::kJsonSchema, kPersonSchema});
  ASSERT_TRUE(c);
  expect_complete(*c, R"({"name": "Ada", "age": 36})");
  expect_rejected(*c, R"({"name": 5, "age": 36})");
  expect_rejected(*c, R"({"name": "Ada"})");  // then EOS is not allowed
  auto m = c->make_matcher();
  feed(*m, R"({"name": "Ada")");
  EXPECT_FALSE(allowed(*m, kEos));
  EXPECT_FALSE(allowed(*m, tok_->encode("}")[0]));  // "age" is required
  expect_rejected(*c, R"({"name": "Ada", "age": 36, "x": 1})");
  // Without the required property the output is not complete, so EOS is never allowed.
  auto m2 = c->make_matcher();
  feed(*m2, R"({"name": "Ada", "age": 3)");
  EXPECT_FALSE(m2->is_terminated());
}

// Speculative decoding's drafts: rollback(n) steps back over the last n accepted tokens, to the
// same allowed set as before them, undoing termination too.
TEST_F(Structured, RollbackReturnsToTheEarlierState) {
  auto c = compile({Kind::kJsonSchema, kPersonSchema});
  ASSERT_TRUE(c);
  auto m = c->make_matcher();
  const auto head = tok_->encode(R"({"name": "Ada", )");
  for (int32_t t : head) ASSERT_TRUE(m->accept(t));
  auto mask = [&] {
    std::vector<uint32_t> bits((kModelVocab + 31) / 32, 0u);
    m->fill_allowed(bits);
    return bits;
  };
  const auto before = mask();
  const auto tail = tok_->encode(R"("age": 36})");
  for (int32_t t : tail) ASSERT_TRUE(m->accept(t));
  ASSERT_TRUE(m->accept(kEos));
  EXPECT_TRUE(m->is_terminated());
  m->rollback(static_cast<int>(tail.size()) + 1);
  EXPECT_FALSE(m->is_terminated());
  EXPECT_EQ(mask(), before);
  // The same continuation is accepted again; a different valid one too after a second rollback.
  for (int32_t t : tail) ASSERT_TRUE(m->accept(t));
  m->rollback(static_cast<int>(tail.size()));
  EXPECT_EQ(feed(*m, R"("age": 7})"), tok_->encode(R"("age": 7})").size());
}

TEST_F(Structured, JsonObjectTakesAnyObjectOnly) {
  auto c = compile({Kind::kJsonObject});
  ASSERT_TRUE(c);
  expect_complete(*c, R"({"a": [1, 2, {"b": null}], "c": "d"})");
  expect_rejected(*c, R"([1, 2])");
  expect_rejected(*c, R"("text")");
}

TEST_F(Structured, RegexChoiceAndGrammar) {
  StructuredOutputSpec re{Kind::kRegex, "[A-Z][a-z]+-[0-9]{3}"};
  auto r = compile(re);
  ASSERT_TRUE(r);
  expect_complete(*r, "Abc-123");
  expect_rejected(*r, "abc-123");
  expect_rejected(*r, "Abc-1234");
  StructuredOutputSpec ch;
  ch.kind = Kind::kChoice;
  ch.choices = {"yes", "no", "maybe so"};
  auto c = compile(ch);
  ASSERT_TRUE(c);
  expect_complete(*c, "maybe so");
  expect_complete(*c, "no");
  expect_rejected(*c, "nope");
  auto g = compile({Kind::kGrammar, R"(root ::= "a" ("b" | "c")* "d")"});
  ASSERT_TRUE(g);
  expect_complete(*g, "abcbd");
  expect_rejected(*g, "abxd");
}

TEST_F(Structured, ReasoningComesFirstThenTheFormat) {
  StructuredOutputSpec ch;
  ch.kind = Kind::kChoice;
  ch.choices = {"yes", "no"};
  auto inside = compile(ch, ReasoningPrefix::kInside);
  ASSERT_TRUE(inside);
  expect_complete(*inside, "I think so, free text {[ here.</mm:think>yes");
  expect_rejected(*inside, "thinking</mm:think>maybe");
  auto optional = compile(ch, ReasoningPrefix::kOptional);
  ASSERT_TRUE(optional);
  expect_complete(*optional, "<mm:think>hmm</mm:think>no");
  expect_complete(*optional, "</mm:think>yes");
  expect_complete(*optional, "yes");
}

const char* kTools = R"([
  {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}},
  {"type": "function", "function": {"name": "ping"}}])";

TEST_F(Structured, ToolCallBlockInTheM3Markup) {
  const std::string ns = "]<]minimax[>[";
  const std::string weather = ns + "<invoke name=\"get_weather\">" + ns + "<city>Paris" + ns +
                              "</city>" + ns + "<days>3" + ns + "</days>" + ns + "</invoke>\n";
  const std::string ping = ns + "<invoke name=\"ping\">" + ns + "</invoke>\n";
  auto block = [&](const std::string& invokes) {
    return ns + "<tool_call>\n" + invokes + ns + "</tool_call>";
  };
  StructuredOutputSpec any;
  any.kind = Kind::kToolCall;
  any.tools = nlohmann::ordered_json::parse(kTools);
  any.param = "tool_choice";
  auto c = compile(any);
  ASSERT_TRUE(c);
  expect_complete(*c, block(weather));
  expect_complete(*c, block(weather + ping));
  expect_rejected(*c, "Sure! " + block(weather));  // the call comes first
  expect_rejected(*c, block(""));                  // at least one call
  expect_rejected(*c, block(ns + "<invoke name=\"nope\">" + ns + "</invoke>\n"));
  expect_rejected(*c, block(ns + "<invoke name=\"get_weather\">" + ns + "<days>x" + ns + "</days>" +
                            ns + "</invoke>\n"));  // days is an integer

  StructuredOutputSpec named = any;
  named.tool_name = "ping";
  auto n = compile(named);
  ASSERT_TRUE(n);
  expect_complete(*n, block(ping));
  expect_rejected(*n, block(weather));
  named.tool_name = "absent";
  auto bad = compiler_->compile(named, ReasoningPrefix::kNone);
  ASSERT_FALSE(bad.has_value());
  EXPECT_EQ(bad.error().param, "tool_choice");
}

// Tool schemas beyond what the XML style expresses (string limits, formats, untyped values,
// free-form dicts, additionalProperties) still give a grammar: the call stays well-formed.
TEST_F(Structured, ToolSchemasAreRelaxedToTheMarkup) {
  const std::string ns = "]<]minimax[>[";
  StructuredOutputSpec spec;
  spec.kind = Kind::kToolCall;
  spec.param = "tool_choice";
  spec.tools = nlohmann::ordered_json::parse(R"([{"type": "function", "function": {"name": "f",
    "parameters": {"type": "object", "additionalProperties": true, "properties": {
      "q": {"type": "string", "minLength": 2, "pattern": "^[a-z]+$", "format": "email"},
      "any": {}, "meta": {"type": "object", "additionalProperties": {"type": "string"}},
      "n": {"type": "integer"}}, "required": ["q", "meta"]}}}])");
  auto c = compile(spec);
  ASSERT_TRUE(c);
  const std::string call = ns + "<tool_call>\n" + ns + "<invoke name=\"f\">" + ns + "<q>A b" + ns +
                           "</q>" + ns + "<any>5" + ns + "</any>" + ns + "<meta>{\"k\": \"v\"}" +
                           ns + "</meta>" + ns + "</invoke>\n" + ns + "</tool_call>";
  expect_complete(*c, call);
}

TEST_F(Structured, InvalidInputsAreErrorsNamingTheField) {
  struct Case {
    StructuredOutputSpec spec;
  };
  std::vector<StructuredOutputSpec> cases = {
      {Kind::kJsonSchema,
       R"({"type": "nonsense"})",
       {},
       {},
       {},
       "response_format.json_schema.schema"},
      {Kind::kJsonSchema, "[1, 2]", {}, {}, {}, "structured_outputs.json"},
      {Kind::kRegex, "[a-", {}, {}, {}, "structured_outputs.regex"},
      {Kind::kGrammar, "root ::= (", {}, {}, {}, "guided_grammar"},
      {Kind::kGrammar, "start: foo", {}, {}, {}, "structured_outputs.grammar"},  // Lark
      {Kind::kStructuralTag, R"({"type": "nonsense"})", {}, {}, {}, "response_format"},
      {Kind::kStructuralTag,
       R"({"type": "triggered_tags", "triggers": ["<a"], "tags": [{"type": "tag",
          "begin": "<a>", "content": {"type": "json_schema", "json_schema": {"type": "bogus"}},
          "end": "</a>"}]})",
       {},
       {},
       {},
       "structured_outputs.structural_tag"},
  };
  for (const auto& s : cases) {
    auto r = compiler_->compile(s, ReasoningPrefix::kNone);
    ASSERT_FALSE(r.has_value()) << s.value;
    EXPECT_EQ(r.error().code, ErrorCode::kInvalidArgument);
    EXPECT_EQ(r.error().param, s.param);
    EXPECT_NE(r.error().message.find(s.param), std::string::npos) << r.error().message;
    EXPECT_EQ(r.error().message.find(".cc:"), std::string::npos) << r.error().message;
  }
}

TEST_F(Structured, LarkGrammarIsConvertedAndEbnfStaysEbnf) {
  // vLLM takes Lark for its xgrammar backend; the same language as the EBNF case above.
  auto g = compile({Kind::kGrammar,
                    "// comment\nstart: \"a\" item* \"d\"\nitem: \"b\" | \"c\"\n",
                    {},
                    {},
                    {},
                    "structured_outputs.grammar"});
  ASSERT_TRUE(g);
  expect_complete(*g, "abcbd");
  expect_rejected(*g, "abxd");
  auto re = compile({Kind::kGrammar, "?start: NUMBER (\",\" NUMBER)*\nNUMBER: /[0-9]+/\n"});
  ASSERT_TRUE(re);
  expect_complete(*re, "12,7,300");
  expect_rejected(*re, "12,,7");
  EXPECT_TRUE(grammar_is_lark("start: \"x\""));
  EXPECT_TRUE(grammar_is_lark("%import common.NUMBER\nstart: NUMBER"));
  EXPECT_TRUE(grammar_is_lark("?value.2 : \"a\""));
  EXPECT_FALSE(grammar_is_lark("root ::= \"a: b\""));
  EXPECT_FALSE(grammar_is_lark("root ::= item\nitem ::= \"x\"\n"));
  EXPECT_FALSE(grammar_is_lark("# just a comment"));
}

TEST_F(Structured, StructuralTagsInBothRequestForms) {
  // Legacy form: free text until a trigger, then a tag whose content follows its schema.
  nlohmann::ordered_json legacy = nlohmann::ordered_json::parse(R"({"type": "structural_tag",
      "triggers": ["<function="], "structures": [{"begin": "<function=get_weather>",
      "schema": {"type": "object", "properties": {"city": {"type": "string"}},
      "required": ["city"], "additionalProperties": false}, "end": "</function>"}]})");
  auto f = structural_tag_format(legacy, "response_format");
  ASSERT_TRUE(f.has_value()) << f.error().message;
  auto c = compile({Kind::kStructuralTag, f->dump()});
  ASSERT_TRUE(c);
  expect_complete(*c, "Let me see. <function=get_weather>{\"city\": \"Oslo\"}</function>");
  expect_complete(*c, "No call needed.");
  expect_rejected(*c, "<function=get_weather>{\"town\": \"Oslo\"}</function>");
  // xgrammar's own format, after an optional reasoning block.
  nlohmann::ordered_json st = nlohmann::ordered_json::parse(R"({"type": "structural_tag",
      "format": {"type": "sequence", "elements": [{"type": "const_string", "value": "A: "},
      {"type": "regex", "pattern": "[0-9]+"}]}})");
  f = structural_tag_format(st, "response_format");
  ASSERT_TRUE(f.has_value());
  auto d = compile({Kind::kStructuralTag, f->dump()}, ReasoningPrefix::kOptional);
  ASSERT_TRUE(d);
  expect_complete(*d, "<mm:think>hmm</mm:think>A: 42");
  expect_complete(*d, "A: 7");
  expect_rejected(*d, "B: 7");
}

TEST_F(Structured, CompiledStructuresAreCachedByContent) {
  auto a = compile({Kind::kJsonSchema, kPersonSchema});
  auto b = compile({Kind::kJsonSchema, kPersonSchema});
  auto c = compile({Kind::kJsonSchema, kPersonSchema}, ReasoningPrefix::kInside);
  EXPECT_EQ(a.get(), b.get());
  EXPECT_NE(a.get(), c.get());
}

}  // namespace
}  // namespace m3::text
