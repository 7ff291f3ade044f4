// gMock matchers for absl::Status / absl::StatusOr shared by the unit tests.
//
//   EXPECT_THAT(ParseMeshSpec("3,2", 4), InvalidArgumentWith(HasSubstr("world size is 4")));
//   EXPECT_THAT(GetIntEnv(env, "RANK"), IsOkAndHolds(3));
#pragma once

#include <ostream>
#include <string>

#include <gmock/gmock.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fsdp::testing {

// For a test's PrintTo(const absl::StatusOr<T>&, std::ostream*) (which must sit in T's
// namespace for gtest to find it): the value as `describe(value)`, or the error status.
template <typename T, typename Describe>
void PrintStatusOr(const absl::StatusOr<T>& result, std::ostream* os, Describe describe) {
  if (result.ok()) {
    *os << describe(*result);
  } else {
    *os << result.status();
  }
}

inline const absl::Status& StatusOf(const absl::Status& status) { return status; }
template <typename T>
const absl::Status& StatusOf(const absl::StatusOr<T>& result) {
  return result.status();
}

// An absl::Status or StatusOr whose code is kInvalidArgument and whose message matches.
MATCHER_P(InvalidArgumentWith, message_matcher,
          std::string(negation ? "isn't" : "is") + " kInvalidArgument with a message that " +
              ::testing::DescribeMatcher<std::string>(message_matcher)) {
  const absl::Status& status = StatusOf(arg);
  if (status.code() != absl::StatusCode::kInvalidArgument) {
    *result_listener << "status is " << status.ToString();
    return false;
  }
  return ::testing::ExplainMatchResult(message_matcher, std::string(status.message()),
                                       result_listener);
}

MATCHER_P(IsOkAndHolds, value, "is OK and holds " + ::testing::PrintToString(value)) {
  if (!arg.ok()) {
    *result_listener << "status is " << arg.status().ToString();
    return false;
  }
  return *arg == value;
}

}  // namespace fsdp::testing
