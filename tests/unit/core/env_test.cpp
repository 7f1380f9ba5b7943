// env_switch: unset / empty keep the default, "1" / "0" set it, anything else keeps the default.
#include <gtest/gtest.h>

#include <cstdlib>

#include "core/env.h"

namespace m3 {
namespace {

constexpr const char* kVar = "M3_ENV_SWITCH_TEST";

TEST(EnvSwitch, UnsetAndEmptyKeepTheDefault) {
  unsetenv(kVar);
  EXPECT_TRUE(env_switch(kVar, true));
  EXPECT_FALSE(env_switch(kVar, false));
  setenv(kVar, "", 1);
  EXPECT_TRUE(env_switch(kVar, true));
  EXPECT_FALSE(env_switch(kVar, false));
}

TEST(EnvSwitch, OneAndZeroSetIt) {
  setenv(kVar, "1", 1);
  EXPECT_TRUE(env_switch(kVar, false));
  setenv(kVar, "0", 1);
  EXPECT_FALSE(env_switch(kVar, true));
  unsetenv(kVar);
}

TEST(EnvSwitch, OtherValuesKeepTheDefault) {
  for (const char* v : {"true", "off", "2", "01", " 1"}) {
    setenv(kVar, v, 1);
    EXPECT_TRUE(env_switch(kVar, true)) << v;
    EXPECT_FALSE(env_switch(kVar, false)) << v;
  }
  unsetenv(kVar);
}

}  // namespace
}  // namespace m3
