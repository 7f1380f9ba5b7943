// On/off switches from the environment (M3_PDL, M3_ENFORCE_EAGER, ...): one parser, so every
// switch takes the same values and none ignores a typo silently.
#pragma once

namespace m3 {

// `def` when `name` is unset or empty; true for "1", false for "0". Any other value keeps `def`
// and logs a warning naming the variable, the value, the accepted values and the one used.
bool env_switch(const char* name, bool def);

}  // namespace m3
