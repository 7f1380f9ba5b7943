#include "text/tok_regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "core/log.h"

namespace m3::text {
namespace {

// Per-thread match state: one ovector pair is enough (only group 0 is read) and a JIT stack
// larger than the 32 KiB default so long runs of letters or spaces never hit the limit.
struct ThreadMatchState {
  pcre2_match_data* data = nullptr;
  pcre2_match_context* ctx = nullptr;
  pcre2_jit_stack* stack = nullptr;
  ThreadMatchState() {
    data = pcre2_match_data_create(1, nullptr);
    ctx = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(64 * 1024, 8 * 1024 * 1024, nullptr);
    if (ctx != nullptr && stack != nullptr) pcre2_jit_stack_assign(ctx, nullptr, stack);
  }
  ~ThreadMatchState() {
    pcre2_match_data_free(data);
    pcre2_match_context_free(ctx);
    pcre2_jit_stack_free(stack);
  }
};

ThreadMatchState& thread_state() {
  thread_local ThreadMatchState state;
  return state;
}

size_t char_len_at(std::string_view s, size_t i) {
  const uint8_t b = static_cast<uint8_t>(s[i]);
  return b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
}

// Rewrites the escapes whose meaning differs between Oniguruma (what HF uses) and PCRE2:
//   \s \S  Oniguruma: Unicode White_Space; PCRE2+UCP also matches U+180E -> \p{White_Space}
//   \w \W  Oniguruma: Alphabetic|Mark|Nd|Pc|Join_Control; PCRE2 differs on marks
//   \h \H  Oniguruma: hex digit; PCRE2: horizontal space
// Other syntax is passed through. `\W`/`\H` inside a character class are left as they are.
std::string onig_to_pcre2(std::string_view pat) {
  constexpr std::string_view kWord = "\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\p{Join_Control}";
  std::string out;
  out.reserve(pat.size() + 16);
  bool in_class = false;
  size_t class_start = 0;  // index in `pat` just after '[' or '[^'
  for (size_t i = 0; i < pat.size(); ++i) {
    const char c = pat[i];
    if (c == '\\' && i + 1 < pat.size()) {
      const char e = pat[i + 1];
      ++i;
      switch (e) {
        case 's':
          out += "\\p{White_Space}";
          continue;
        case 'S':
          out += "\\P{White_Space}";
          continue;
        case 'w':
          out += in_class ? std::string(kWord) : "[" + std::string(kWord) + "]";
          continue;
        case 'W':
          if (!in_class) {
            out += "[^" + std::string(kWord) + "]";
            continue;
          }
          break;
        case 'h':
          out += in_class ? "0-9a-fA-F" : "[0-9a-fA-F]";
          continue;
        case 'H':
          if (!in_class) {
            out += "[^0-9a-fA-F]";
            continue;
          }
          break;
        default:
          break;
      }
      out.push_back('\\');
      out.push_back(e);
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out.push_back(c);
      if (i + 1 < pat.size() && pat[i + 1] == '^') out.push_back(pat[++i]);
      class_start = i + 1;
      continue;
    }
    if (in_class && c == '[' && i + 1 < pat.size() && pat[i + 1] == ':') {
      const size_t end = pat.find(":]", i + 2);  // POSIX class such as [:alpha:]
      if (end != std::string_view::npos) {
        out.append(pat.substr(i, end + 2 - i));
        i = end + 1;
        continue;
      }
    }
    if (in_class && c == ']' && i != class_start) in_class = false;
    out.push_back(c);
  }
  return out;
}

}  // namespace

Result<std::unique_ptr<TokRegex>> TokRegex::compile(std::string_view pattern, bool literal) {
  int err = 0;
  PCRE2_SIZE err_off = 0;
  // PCRE2_LITERAL does not combine with UCP (no classes to interpret anyway).
  const uint32_t options = literal ? (PCRE2_UTF | PCRE2_LITERAL | PCRE2_NO_UTF_CHECK)
                                   : (PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK);
  const std::string translated = literal ? std::string(pattern) : onig_to_pcre2(pattern);
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()),
                                   translated.size(), options, &err, &err_off, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof(msg));
    return make_error(ErrorCode::kUnsupported,
                      "tokenizer.json: pre-tokenizer regex does not compile with PCRE2 at offset " +
                          std::to_string(err_off) + ": " + reinterpret_cast<const char*>(msg) +
                          " (pattern: " + std::string(pattern) + ")");
  }
  std::unique_ptr<TokRegex> re(new TokRegex());
  re->code_ = code;
  re->pattern_ = std::string(pattern);
  re->jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  return re;
}

TokRegex::~TokRegex() {
  pcre2_code_free(static_cast<pcre2_code*>(code_));
}

void TokRegex::find_all(std::string_view s, std::vector<std::pair<size_t, size_t>>& out) const {
  out.clear();
  ThreadMatchState& st = thread_state();
  auto* code = static_cast<pcre2_code*>(code_);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  const size_t n = s.size();
  size_t last_end = 0;
  bool have_last = false;
  size_t last_match_end = 0;
  while (last_end <= n) {
    int rc = jit_ ? pcre2_jit_match(code, subject, n, last_end, PCRE2_NO_UTF_CHECK, st.data, st.ctx)
                  : pcre2_match(code, subject, n, last_end, PCRE2_NO_UTF_CHECK, st.data, st.ctx);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      // Resource limits only (the subject is valid UTF-8): keep the rest as one unmatched piece.
      M3_LOG_WARN("tokenizer regex: PCRE2 error %d at byte %zu; rest of the piece left unsplit", rc,
                  last_end);
      break;
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.data);
    const size_t ms = ov[0], me = ov[1];
    if (ms == me && have_last && last_match_end == me) {
      // Oniguruma iteration: an empty match right after the previous one advances one char.
      last_end += last_end < n ? char_len_at(s, last_end) : 1;
      continue;
    }
    last_end = me;
    have_last = true;
    last_match_end = me;
    out.emplace_back(ms, me);
  }
}

}  // namespace m3::text
