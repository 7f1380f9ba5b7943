// Built-in chat templates shipped inside the binary.
// Called by ChatTemplate::from_model_dir when a model directory carries no chat template.
// Invariant: kMiniMaxM3ChatTemplate is byte-identical to
// tests/golden/text/templates/minimax_m3.jinja (text_jinja_test checks it), and renders the
// MiniMax-M3 prompt layout of docs m3-model.md sections 6.2-6.3.
#pragma once

#include <string_view>

namespace m3::text {

// Our own MiniMax-M3 template. The generic thinking paragraph and the tool-call example are our
// text (the shipped template's wording is unverified); everything else follows the spec.
extern const std::string_view kMiniMaxM3ChatTemplate;

}  // namespace m3::text
