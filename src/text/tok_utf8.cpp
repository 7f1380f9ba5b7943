#include "text/tok_utf8.h"

#include <utf8proc.h>

namespace m3::text {
namespace {

// Second-byte range allowed after lead byte `b` (Unicode Table 3-7); need = continuation count.
// Returns false for bytes that can never start a sequence.
bool lead_info(uint8_t b, int* need, uint8_t* lo, uint8_t* hi) {
  *lo = 0x80;
  *hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) {
    *need = 1;
  } else if (b == 0xE0) {
    *need = 2;
    *lo = 0xA0;
  } else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) {
    *need = 2;
  } else if (b == 0xED) {
    *need = 2;
    *hi = 0x9F;  // excludes UTF-16 surrogates
  } else if (b == 0xF0) {
    *need = 3;
    *lo = 0x90;
  } else if (b >= 0xF1 && b <= 0xF3) {
    *need = 3;
  } else if (b == 0xF4) {
    *need = 3;
    *hi = 0x8F;  // caps at U+10FFFF
  } else {
    return false;
  }
  return true;
}

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";

}  // namespace

bool utf8_valid(std::string_view s) {
  size_t i = 0;
  const size_t n = s.size();
  while (i < n) {
    const uint8_t b = static_cast<uint8_t>(s[i]);
    if (b < 0x80) {
      ++i;
      continue;
    }
    int need = 0;
    uint8_t lo = 0, hi = 0;
    if (!lead_info(b, &need, &lo, &hi)) return false;
    if (n - i <= static_cast<size_t>(need)) return false;  // truncated at the end
    for (int k = 0; k < need; ++k) {
      const uint8_t c = static_cast<uint8_t>(s[i + 1 + k]);
      const uint8_t l = k == 0 ? lo : 0x80, h = k == 0 ? hi : 0xBF;
      if (c < l || c > h) return false;
    }
    i += 1 + need;
  }
  return true;
}

size_t utf8_append_lossy(std::string_view in, std::string& out, bool final) {
  size_t i = 0;
  const size_t n = in.size();
  while (i < n) {
    // Copy ASCII runs in one go (the common case).
    size_t j = i;
    while (j < n && static_cast<uint8_t>(in[j]) < 0x80) ++j;
    if (j > i) {
      out.append(in.data() + i, j - i);
      i = j;
      if (i == n) break;
    }
    const uint8_t b = static_cast<uint8_t>(in[i]);
    int need = 0;
    uint8_t lo = 0, hi = 0;
    if (!lead_info(b, &need, &lo, &hi)) {
      out.append(kReplacement);
      ++i;
      continue;
    }
    size_t k = 0;
    bool bad = false;
    for (; k < static_cast<size_t>(need); ++k) {
      if (i + 1 + k >= n) break;  // ran out of input mid-sequence
      const uint8_t c = static_cast<uint8_t>(in[i + 1 + k]);
      const uint8_t l = k == 0 ? lo : 0x80, h = k == 0 ? hi : 0xBF;
      if (c < l || c > h) {
        bad = true;
        break;
      }
    }
    if (bad) {
      out.append(kReplacement);  // the maximal subpart in[i, i+1+k) becomes one U+FFFD
      i += 1 + k;
    } else if (k < static_cast<size_t>(need)) {
      if (!final) return i;  // valid prefix of a character: wait for more bytes
      out.append(kReplacement);
      i = n;
    } else {
      out.append(in.data() + i, 1 + need);
      i += 1 + need;
    }
  }
  return n;
}

char32_t utf8_decode_at(std::string_view s, size_t i, size_t* len) {
  const uint8_t b = static_cast<uint8_t>(s[i]);
  size_t l = b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
  if (i + l > s.size()) l = s.size() - i;  // defensive: never read past the view
  char32_t cp = l == 1 ? b : l == 2 ? (b & 0x1F) : l == 3 ? (b & 0x0F) : (b & 0x07);
  for (size_t k = 1; k < l; ++k) cp = (cp << 6) | (static_cast<uint8_t>(s[i + k]) & 0x3F);
  *len = l;
  return cp;
}

char32_t utf8_decode_last(std::string_view s) {
  size_t i = s.size() - 1;
  size_t back = 0;
  while (i > 0 && back < 3 && (static_cast<uint8_t>(s[i]) & 0xC0) == 0x80) {
    --i;
    ++back;
  }
  size_t len = 0;
  return utf8_decode_at(s, i, &len);
}

void utf8_append(char32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

bool is_unicode_whitespace(char32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

bool is_unicode_word(char32_t cp) {
  if (cp < 0x80) {
    return (cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') ||
           cp == '_';
  }
  if (cp == 0x200C || cp == 0x200D) return true;  // Join_Control
  // Other_Alphabetic symbols (circled / squared Latin letters) that are category So.
  if ((cp >= 0x24B6 && cp <= 0x24E9) || (cp >= 0x1F130 && cp <= 0x1F149) ||
      (cp >= 0x1F150 && cp <= 0x1F169) || (cp >= 0x1F170 && cp <= 0x1F189)) {
    return true;
  }
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

}  // namespace m3::text
