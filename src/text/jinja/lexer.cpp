// Jinja lexer, following jinja2 3.1's lexer.py rules for the environment transformers builds.
#include "text/jinja/lexer.h"

#include <algorithm>
#include <cstring>

#include "text/jinja/value.h"

namespace m3::text::jinja {

std::string located_message(const std::string& name, int line, int col, const std::string& what) {
  return name + ": line " + std::to_string(line) + ", column " + std::to_string(col) + ": " + what;
}

namespace {

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}
bool is_digit(char c) {
  return c >= '0' && c <= '9';
}
bool is_name_start(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}
bool is_name_char(char c) {
  return is_name_start(c) || is_digit(c);
}

struct LexFail {
  size_t pos;
  std::string what;
};

class Lexer {
 public:
  Lexer(std::string src, const std::string& name) : src_(std::move(src)), name_(name) {
    line_starts_.push_back(0);
    for (size_t i = 0; i < src_.size(); ++i)
      if (src_[i] == '\n') line_starts_.push_back(i + 1);
  }

  Result<std::vector<Token>> run() {
    try {
      lex_root();
    } catch (const LexFail& f) {
      auto [line, col] = position(f.pos);
      return make_error(ErrorCode::kFormat, located_message(name_, line, col, f.what));
    }
    Token eof{TokenKind::kEof, "", 0, 0};
    std::tie(eof.line, eof.col) = position(src_.size());
    tokens_.push_back(eof);
    return std::move(tokens_);
  }

 private:
  std::pair<int, int> position(size_t pos) const {
    auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), pos);
    size_t line_idx = static_cast<size_t>(it - line_starts_.begin()) - 1;
    size_t start = line_starts_[line_idx];
    size_t end = std::min(pos, src_.size());
    int col = 1 + static_cast<int>(utf8_length(std::string_view(src_).substr(start, end - start)));
    return {static_cast<int>(line_idx) + 1, col};
  }

  void emit(TokenKind kind, std::string text, size_t pos) {
    Token t{kind, std::move(text), 0, 0};
    std::tie(t.line, t.col) = position(pos);
    tokens_.push_back(std::move(t));
  }

  bool starts_with(size_t pos, const char* s) const {
    size_t n = std::strlen(s);
    return pos + n <= src_.size() && src_.compare(pos, n, s) == 0;
  }

  size_t skip_ws(size_t pos) const {
    while (pos < src_.size() && is_space(src_[pos])) ++pos;
    return pos;
  }

  // jinja2's OptionalLStrip: the data before a tag loses trailing whitespace with `-`, or the
  // indentation of its last line with lstrip_blocks (block and comment tags, not `{{`).
  std::string strip_data(std::string text, char sign, bool is_variable) const {
    if (sign == '-') {
      size_t end = text.size();
      while (end > 0 && is_space(text[end - 1])) --end;
      text.resize(end);
    } else if (sign != '+' && !is_variable) {
      size_t nl = text.rfind('\n');
      size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
      if (l_pos > 0 || line_starting_) {
        bool all_ws = l_pos < text.size();
        for (size_t i = l_pos; i < text.size(); ++i)
          if (!is_space(text[i])) all_ws = false;
        if (all_ws) text.resize(l_pos);
      }
    }
    return text;
  }

  void lex_root() {
    size_t pos = 0;
    const size_t n = src_.size();
    while (pos < n) {
      size_t p = pos;
      while (true) {
        p = src_.find('{', p);
        if (p == std::string::npos || p + 1 >= n) {
          p = std::string::npos;
          break;
        }
        char k = src_[p + 1];
        if (k == '{' || k == '%' || k == '#') break;
        ++p;
      }
      if (p == std::string::npos) {
        emit(TokenKind::kData, src_.substr(pos), pos);
        return;
      }
      char kind = src_[p + 1];
      char sign = (p + 2 < n && (src_[p + 2] == '-' || src_[p + 2] == '+')) ? src_[p + 2] : 0;
      size_t after = p + 2 + (sign ? 1 : 0);
      size_t raw_body = raw_begin(kind, after);
      std::string text = strip_data(src_.substr(pos, p - pos), sign, kind == '{');
      if (!text.empty()) emit(TokenKind::kData, std::move(text), pos);
      if (raw_body != std::string::npos) {
        pos = lex_raw(raw_body, p);
      } else if (kind == '#') {
        pos = lex_comment(after, p);
      } else {
        pos = lex_tag(kind == '{', p, after);
      }
    }
  }

  // `{%(-|+|)\s*raw\s*(-%}\s*|%})`: returns the position after it, or npos when not a raw tag.
  size_t raw_begin(char kind, size_t after) const {
    if (kind != '%') return std::string::npos;
    size_t q = skip_ws(after);
    if (!starts_with(q, "raw")) return std::string::npos;
    q = skip_ws(q + 3);
    if (starts_with(q, "-%}")) return skip_ws(q + 3);
    if (starts_with(q, "%}")) return q + 2;
    return std::string::npos;
  }

  size_t lex_raw(size_t body, size_t open_pos) {
    line_starting_ = src_[body - 1] == '\n';
    for (size_t q = src_.find("{%", body); q != std::string::npos; q = src_.find("{%", q + 1)) {
      char sign =
          (q + 2 < src_.size() && (src_[q + 2] == '-' || src_[q + 2] == '+')) ? src_[q + 2] : 0;
      size_t r = skip_ws(q + 2 + (sign ? 1 : 0));
      if (!starts_with(r, "endraw")) continue;
      r = skip_ws(r + 6);
      size_t end;
      if (starts_with(r, "+%}")) {
        end = r + 3;
      } else if (starts_with(r, "-%}")) {
        end = skip_ws(r + 3);
      } else if (starts_with(r, "%}")) {
        end = r + 2;
        if (end < src_.size() && src_[end] == '\n') ++end;  // trim_blocks
      } else {
        continue;
      }
      std::string text = strip_data(src_.substr(body, q - body), sign, false);
      if (!text.empty()) emit(TokenKind::kData, std::move(text), body);
      line_starting_ = src_[end - 1] == '\n';
      return end;
    }
    throw LexFail{open_pos, "missing end of raw directive ({% endraw %})"};
  }

  size_t lex_comment(size_t from, size_t open_pos) {
    for (size_t q = from; q < src_.size(); ++q) {
      size_t end;
      if (starts_with(q, "+#}")) {
        end = q + 3;
      } else if (starts_with(q, "-#}")) {
        end = skip_ws(q + 3);
      } else if (starts_with(q, "#}")) {
        end = q + 2;
        if (end < src_.size() && src_[end] == '\n') ++end;  // trim_blocks applies to comments
      } else {
        continue;
      }
      line_starting_ = src_[end - 1] == '\n';
      return end;
    }
    throw LexFail{open_pos, "missing end of comment tag '#}'"};
  }

  // Digits with single '_' separators: (\d+_)*\d+ ; returns end or npos.
  size_t match_digits(size_t pos) const {
    if (pos >= src_.size() || !is_digit(src_[pos])) return std::string::npos;
    size_t q = pos;
    while (true) {
      while (q < src_.size() && is_digit(src_[q])) ++q;
      if (q + 1 < src_.size() && src_[q] == '_' && is_digit(src_[q + 1])) {
        ++q;
        continue;
      }
      return q;
    }
  }

  size_t match_float(size_t pos) const {
    if (pos > 0 && src_[pos - 1] == '.') return std::string::npos;
    size_t q = match_digits(pos);
    if (q == std::string::npos) return q;
    auto exponent = [&](size_t e) -> size_t {
      if (e < src_.size() && (src_[e] == 'e' || src_[e] == 'E')) {
        size_t s = e + 1;
        if (s < src_.size() && (src_[s] == '+' || src_[s] == '-')) ++s;
        return match_digits(s);
      }
      return std::string::npos;
    };
    if (q < src_.size() && src_[q] == '.') {
      size_t frac = match_digits(q + 1);
      if (frac != std::string::npos) {
        size_t e = exponent(frac);
        return e != std::string::npos ? e : frac;
      }
    }
    return exponent(q);
  }

  size_t match_int(size_t pos) const {
    char c = src_[pos];
    if (!is_digit(c)) return std::string::npos;
    if (c == '0' && pos + 1 < src_.size()) {
      char b = static_cast<char>(src_[pos + 1] | 0x20);
      auto ok = [&](char d) {
        d = static_cast<char>(d | 0x20);
        if (b == 'b') return d == '0' || d == '1';
        if (b == 'o') return d >= '0' && d <= '7';
        return is_digit(d) || (d >= 'a' && d <= 'f');
      };
      if (b == 'b' || b == 'o' || b == 'x') {
        size_t q = pos + 2;
        size_t last = std::string::npos;
        while (q < src_.size()) {
          if (src_[q] == '_' && q + 1 < src_.size() && ok(src_[q + 1]))
            q += 2;
          else if (ok(src_[q]))
            ++q;
          else
            break;
          last = q;
        }
        if (last != std::string::npos) return last;
      }
    }
    if (c == '0') {
      size_t q = pos + 1;
      while (q < src_.size()) {
        if (src_[q] == '0')
          ++q;
        else if (src_[q] == '_' && q + 1 < src_.size() && src_[q + 1] == '0')
          q += 2;
        else
          break;
      }
      return q;
    }
    size_t q = pos + 1;
    while (q < src_.size()) {
      if (is_digit(src_[q]))
        ++q;
      else if (src_[q] == '_' && q + 1 < src_.size() && is_digit(src_[q + 1]))
        q += 2;
      else
        break;
    }
    return q;
  }

  // Python "unicode-escape" decoding of a string literal body, as jinja2 applies it.
  std::string unescape(std::string_view body, size_t pos) const {
    std::string out;
    for (size_t i = 0; i < body.size(); ++i) {
      char c = body[i];
      if (c != '\\' || i + 1 >= body.size()) {
        out += c;
        continue;
      }
      char e = body[++i];
      auto hex = [&](size_t count) -> uint32_t {
        uint32_t v = 0;
        for (size_t k = 1; k <= count; ++k) {
          if (i + k >= body.size())
            throw LexFail{pos, "truncated escape sequence in string literal"};
          char h = body[i + k];
          int d = is_digit(h)                                ? h - '0'
                  : ((h | 0x20) >= 'a' && (h | 0x20) <= 'f') ? (h | 0x20) - 'a' + 10
                                                             : -1;
          if (d < 0) throw LexFail{pos, "truncated escape sequence in string literal"};
          v = v * 16 + static_cast<uint32_t>(d);
        }
        i += count;
        return v;
      };
      switch (e) {
        case '\n':
          break;  // line continuation
        case '\\':
          out += '\\';
          break;
        case '\'':
          out += '\'';
          break;
        case '"':
          out += '"';
          break;
        case 'a':
          out += '\a';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'v':
          out += '\v';
          break;
        case 'x':
          utf8_append(out, hex(2));
          break;
        case 'u':
          utf8_append(out, hex(4));
          break;
        case 'U': {
          uint32_t cp = hex(8);
          if (cp > 0x10ffff) throw LexFail{pos, "illegal Unicode character in string literal"};
          utf8_append(out, cp);
          break;
        }
        case 'N':
          throw LexFail{pos, "named unicode escapes (\\N{...}) are not supported"};
        default:
          if (e >= '0' && e <= '7') {
            uint32_t v = static_cast<uint32_t>(e - '0');
            for (int k = 0;
                 k < 2 && i + 1 < body.size() && body[i + 1] >= '0' && body[i + 1] <= '7'; ++k)
              v = v * 8 + static_cast<uint32_t>(body[++i] - '0');
            utf8_append(out, v);
          } else {
            out += '\\';  // unknown escapes keep their backslash, as Python does
            out += e;
          }
      }
    }
    return out;
  }

  size_t lex_tag(bool is_variable, size_t open_pos, size_t pos) {
    emit(is_variable ? TokenKind::kVarBegin : TokenKind::kBlockBegin, is_variable ? "{{" : "{%",
         open_pos);
    std::vector<std::pair<char, size_t>> balance;
    const size_t n = src_.size();
    while (true) {
      pos = skip_ws(pos);
      if (pos >= n) {
        throw LexFail{
            open_pos,
            std::string(
                "unexpected end of template, the tag opened here was never closed (expected '") +
                (is_variable ? "}}" : "%}") + "')"};
      }
      if (balance.empty()) {
        if (is_variable) {
          if (starts_with(pos, "-}}")) {
            emit(TokenKind::kVarEnd, "}}", pos);
            size_t end = skip_ws(pos + 3);
            line_starting_ = src_[end - 1] == '\n';
            return end;
          }
          if (starts_with(pos, "}}")) {
            emit(TokenKind::kVarEnd, "}}", pos);
            line_starting_ = false;
            return pos + 2;
          }
        } else {
          if (starts_with(pos, "+%}")) {
            emit(TokenKind::kBlockEnd, "%}", pos);
            line_starting_ = false;
            return pos + 3;
          }
          if (starts_with(pos, "-%}")) {
            emit(TokenKind::kBlockEnd, "%}", pos);
            size_t end = skip_ws(pos + 3);
            line_starting_ = src_[end - 1] == '\n';
            return end;
          }
          if (starts_with(pos, "%}")) {
            emit(TokenKind::kBlockEnd, "%}", pos);
            size_t end = pos + 2;
            if (end < n && src_[end] == '\n') ++end;  // trim_blocks
            line_starting_ = src_[end - 1] == '\n';
            return end;
          }
        }
      }
      char c = src_[pos];
      size_t end;
      if ((end = match_float(pos)) != std::string::npos) {
        std::string t;
        for (size_t i = pos; i < end; ++i)
          if (src_[i] != '_') t += src_[i];
        emit(TokenKind::kFloat, std::move(t), pos);
        pos = end;
        continue;
      }
      if ((end = match_int(pos)) != std::string::npos) {
        std::string t;
        for (size_t i = pos; i < end; ++i)
          if (src_[i] != '_') t += src_[i];
        emit(TokenKind::kInt, std::move(t), pos);
        pos = end;
        continue;
      }
      if (is_name_start(c)) {
        end = pos;
        while (end < n && is_name_char(src_[end])) ++end;
        emit(TokenKind::kName, src_.substr(pos, end - pos), pos);
        pos = end;
        continue;
      }
      if (c == '\'' || c == '"') {
        end = pos + 1;
        while (end < n && src_[end] != c) end += src_[end] == '\\' ? 2 : 1;
        if (end >= n)
          throw LexFail{pos,
                        std::string("unterminated string literal (missing closing ") + c + ")"};
        emit(TokenKind::kString,
             unescape(std::string_view(src_).substr(pos + 1, end - pos - 1), pos), pos);
        pos = end + 1;
        continue;
      }
      static const char* kOps2[] = {"//", "**", "==", "!=", ">=", "<="};
      bool two = false;
      for (const char* op : kOps2) {
        if (starts_with(pos, op)) {
          emit(TokenKind::kOp, op, pos);
          pos += 2;
          two = true;
          break;
        }
      }
      if (two) continue;
      if (std::strchr("+-/*%~[](){}><=.:|,;", c) && c != 0) {
        if (c == '(' || c == '[' || c == '{') {
          balance.emplace_back(c == '(' ? ')' : c == '[' ? ']' : '}', pos);
        } else if (c == ')' || c == ']' || c == '}') {
          if (balance.empty()) throw LexFail{pos, std::string("unexpected '") + c + "'"};
          char expected = balance.back().first;
          balance.pop_back();
          if (expected != c)
            throw LexFail{pos, std::string("unexpected '") + c + "', expected '" + expected + "'"};
        }
        emit(TokenKind::kOp, std::string(1, c), pos);
        ++pos;
        continue;
      }
      std::string shown = (static_cast<unsigned char>(c) < 0x20)
                              ? "\\x" + std::to_string(static_cast<int>(c))
                              : std::string(1, c);
      throw LexFail{pos, "unexpected character '" + shown + "' inside a tag"};
    }
  }

  std::string src_;
  const std::string& name_;
  std::vector<size_t> line_starts_;
  std::vector<Token> tokens_;
  bool line_starting_ = true;
};

}  // namespace

Result<std::vector<Token>> tokenize(std::string_view source, const std::string& name) {
  // Normalise \r\n and \r to \n, then drop one trailing newline (keep_trailing_newline=False).
  std::string src;
  src.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      src += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      src += source[i];
    }
  }
  if (!src.empty() && src.back() == '\n') src.pop_back();
  Lexer lexer(std::move(src), name);
  return lexer.run();
}

}  // namespace m3::text::jinja
