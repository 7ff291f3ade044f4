#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "common/env.h"
#include "common/env_knobs.h"
#include "common/failure.h"
#include "common/strings.h"
#include "common/user_input.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace fsdp {
namespace {

using testing::InvalidArgumentWith;
using testing::IsOkAndHolds;

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Optional;

TEST(StrCatTest, FormatsEachArgument) {
  EXPECT_EQ(StrCat("rank ", 3, " of ", 4), "rank 3 of 4");
  EXPECT_EQ(StrCat(), "");
  EXPECT_EQ(StrCat(""), "");
  EXPECT_EQ(StrCat(std::string("a"), std::string_view("b"), 'c', -7), "abc-7");
  EXPECT_EQ(StrCat(1.5, " ", true, " ", int64_t{1} << 40), "1.5 true 1099511627776");
  EXPECT_EQ(StrCat(std::numeric_limits<int>::min()), "-2147483648");
}

TEST(StrJoinTest, JoinsWithSeparator) {
  EXPECT_EQ(StrJoin(std::vector<int>{0, 2}, ", "), "0, 2");
  EXPECT_EQ(StrJoin(std::vector<int>{}, ", "), "");
  EXPECT_EQ(StrJoin(std::vector<int>{7}, ", "), "7");
  EXPECT_EQ(StrJoin(std::vector<std::string>{"a", "", "c"}, "/"), "a//c");
  EXPECT_EQ(StrJoin(std::vector<std::string_view>{"x", "y"}, ""), "xy");
  EXPECT_EQ(StrJoin(std::vector<int>{2, 3, 4}, " x "), "2 x 3 x 4");
}

TEST(SplitTest, KeepsEmptyPieces) {
  EXPECT_THAT(Split("a, b,,c", ","), ElementsAre("a", " b", "", "c"));
  EXPECT_THAT(Split("", ","), ElementsAre(""));
  EXPECT_THAT(Split("abc", ","), ElementsAre("abc"));
  EXPECT_THAT(Split(",", ","), ElementsAre("", ""));
  EXPECT_THAT(Split(",a,", ","), ElementsAre("", "a", ""));
  EXPECT_THAT(Split("abc", ""), ElementsAre("abc"));
}

TEST(SplitTest, AnyOfSeveralSeparators) {
  EXPECT_THAT(Split("2x3,4", ",x"), ElementsAre("2", "3", "4"));
  EXPECT_THAT(Split("a;b c", "; "), ElementsAre("a", "b", "c"));
  EXPECT_THAT(Split("x,", ",x"), ElementsAre("", "", ""));
}

TEST(SplitTest, PiecesViewTheInput) {
  std::string_view input = "ab,cd";
  std::vector<std::string_view> pieces = Split(input, ",");
  ASSERT_EQ(pieces.size(), 2u);
  EXPECT_EQ(pieces[0].data(), input.data());
  EXPECT_EQ(pieces[1].data(), input.data() + 3);
}

TEST(StripTest, RemovesSurroundingWhitespace) {
  EXPECT_EQ(Strip("  a b \t\r\n"), "a b");
  EXPECT_EQ(Strip("\n\tx"), "x");
  EXPECT_EQ(Strip("x"), "x");
  EXPECT_EQ(Strip(""), "");
  EXPECT_EQ(Strip(" \t\r\n "), "");
  EXPECT_EQ(Strip("a  b"), "a  b");
  EXPECT_EQ(Strip("\va\f"), "\va\f") << "only space, tab, CR and LF are stripped";
}

TEST(StartsWithTest, Prefixes) {
  EXPECT_TRUE(StartsWith("torchrun", "torch"));
  EXPECT_TRUE(StartsWith("torch", "torch"));
  EXPECT_TRUE(StartsWith("torch", ""));
  EXPECT_FALSE(StartsWith("tor", "torch"));
  EXPECT_FALSE(StartsWith("Torch", "torch"));
}

TEST(ParseIntTest, AcceptsWholeIntegers) {
  EXPECT_THAT(ParseInt("42"), Optional(42));
  EXPECT_THAT(ParseInt("-1"), Optional(-1));
  EXPECT_THAT(ParseInt("0"), Optional(0));
  EXPECT_THAT(ParseInt("-0"), Optional(0));
  EXPECT_THAT(ParseInt("007"), Optional(7));
  EXPECT_THAT(ParseInt("2147483647"), Optional(std::numeric_limits<int>::max()));
  EXPECT_THAT(ParseInt("-2147483648"), Optional(std::numeric_limits<int>::min()));
}

TEST(ParseIntTest, RejectsEverythingElse) {
  for (const char* s : {"", " 42", "42 ", "+1", "4x", "x4", "1.5", "1e3", "0x10", "-", "--1",
                        "2147483648", "-2147483649", "99999999999999999999", "١"}) {
    EXPECT_EQ(ParseInt(s), std::nullopt) << "'" << s << "'";
  }
}

TEST(ParseIntTest, OtherIntegerTypes) {
  EXPECT_THAT(ParseInt<int64_t>("9999999999"), Optional(int64_t{9999999999}));
  EXPECT_EQ(ParseInt<int64_t>("99999999999999999999"), std::nullopt);
  EXPECT_THAT(ParseInt<unsigned>("4294967295"), Optional(4294967295u));
  EXPECT_EQ(ParseInt<unsigned>("-1"), std::nullopt);
}

TEST(ParseIntTest, UsesOnlyTheViewNotTheBytesAfterIt) {
  std::string_view digits = std::string_view("123456").substr(0, 3);
  EXPECT_THAT(ParseInt(digits), Optional(123));
}

TEST(ParseBinarySizeTest, PlainBytesAndBinaryUnits) {
  EXPECT_THAT(ParseBinarySize("4096"), IsOkAndHolds(4096));
  EXPECT_THAT(ParseBinarySize("64K"), IsOkAndHolds(64 << 10));
  EXPECT_THAT(ParseBinarySize("16m"), IsOkAndHolds(16 << 20));
  EXPECT_THAT(ParseBinarySize("3G"), IsOkAndHolds(int64_t{3} << 30));
  EXPECT_THAT(ParseBinarySize("8589934591G"), IsOkAndHolds(int64_t{8589934591} << 30));
  EXPECT_THAT(ParseBinarySize("9223372036854775807"),
              IsOkAndHolds(std::numeric_limits<int64_t>::max()));
}

TEST(ParseBinarySizeTest, RejectsTextThatIsNotASize) {
  for (const char* s : {"", "K", "-1", "-4K", "+4K", " 4K", "4 K", "4KB", "1.5G", "4T", "0x10"}) {
    EXPECT_THAT(ParseBinarySize(s), InvalidArgumentWith(HasSubstr("is not a size like 4096")))
        << "'" << s << "'";
  }
}

// Multiplying without a check wrapped 99999999999999999G to about 1.5e18 bytes.
TEST(ParseBinarySizeTest, TooLargeIsAnErrorNotAWrap) {
  for (const char* s : {"99999999999999999G", "8589934592G", "8796093022208M", "9007199254740992K",
                        "9223372036854775808", "99999999999999999999"}) {
    EXPECT_THAT(ParseBinarySize(s),
                InvalidArgumentWith(AllOf(HasSubstr(StrCat("'", s, "' is too large")),
                                          HasSubstr("at most 8589934591G"))))
        << s;
  }
}

TEST(SafeFileNameTest, NeverLeavesItsFolder) {
  EXPECT_EQ(SafeFileName("tiny-gpt_1.5"), "tiny-gpt_1.5");
  EXPECT_EQ(SafeFileName("/tmp/v"), "_tmp_v");
  EXPECT_EQ(SafeFileName("../../victim"), ".._.._victim");
  EXPECT_EQ(SafeFileName("a b\\c"), "a_b_c");
  EXPECT_EQ(SafeFileName(std::string_view("a\0b", 3)), "a_b");
  for (const char* dots : {"", ".", ".."}) {
    const std::string name = SafeFileName(dots);
    EXPECT_FALSE(name.empty()) << "'" << dots << "'";
    EXPECT_EQ(name.find('.'), std::string::npos) << name;
    const std::filesystem::path inside = std::filesystem::path("/out") / name;
    EXPECT_EQ(inside.lexically_normal().parent_path(), "/out") << name;
  }
}

TEST(ToLowerTest, LowersAsciiOnly) {
  EXPECT_EQ(ToLower("MiXeD 123_Z"), "mixed 123_z");
  EXPECT_EQ(ToLower(""), "");
  EXPECT_EQ(ToLower("already"), "already");
  EXPECT_EQ(ToLower(std::string_view("AB\0C", 4)), std::string("ab\0c", 4));
  EXPECT_EQ(ToLower("\xC3\x89"), "\xC3\x89") << "non-ASCII bytes are left alone";
}

TEST(CsvFieldTest, QuotesOnlyWhatWouldBreakTheColumns) {
  EXPECT_EQ(CsvField("gpt_125m"), "gpt_125m");
  EXPECT_EQ(CsvField(""), "");
  EXPECT_EQ(CsvField("a,b"), "\"a,b\"");
  EXPECT_EQ(CsvField("say \"hi\""), "\"say \"\"hi\"\"\"");
  EXPECT_EQ(CsvField("two\nlines"), "\"two\nlines\"");
}

TEST(ContainsIgnoreCaseTest, FindsNeedleInAnyCase) {
  EXPECT_TRUE(ContainsIgnoreCase("Hello World", "WORLD"));
  EXPECT_TRUE(ContainsIgnoreCase("Hello World", "lo w"));
  EXPECT_TRUE(ContainsIgnoreCase("NCCL error", "nccl"));
  EXPECT_TRUE(ContainsIgnoreCase("abc", ""));
  EXPECT_TRUE(ContainsIgnoreCase("", ""));
  EXPECT_TRUE(ContainsIgnoreCase("abc", "ABC"));
  EXPECT_FALSE(ContainsIgnoreCase("", "a"));
  EXPECT_FALSE(ContainsIgnoreCase("abc", "abcd"));
  EXPECT_FALSE(ContainsIgnoreCase("a b", "ab"));
}

TEST(MapEnvTest, LooksUpVariables) {
  EnvLookup env = MapEnv({{"A", "1"}, {"B", "two"}, {"EMPTY", ""}});
  EXPECT_THAT(env("A"), Optional(std::string("1")));
  EXPECT_THAT(env("B"), Optional(std::string("two")));
  EXPECT_EQ(env("EMPTY"), std::nullopt) << "empty values count as unset";
  EXPECT_EQ(env("MISSING"), std::nullopt);
  EXPECT_EQ(env("a"), std::nullopt) << "names are case-sensitive";
  EXPECT_EQ(MapEnv({})("A"), std::nullopt);
}

TEST(MapEnvTest, OwnsACopyOfTheMap) {
  std::map<std::string, std::string> vars = {{"A", "1"}};
  EnvLookup env = MapEnv(vars);
  vars["A"] = "2";
  vars["B"] = "3";
  EXPECT_THAT(env("A"), Optional(std::string("1")));
  EXPECT_EQ(env("B"), std::nullopt);
  EnvLookup copy = env;
  EXPECT_THAT(copy("A"), Optional(std::string("1")));
}

TEST(ProcessEnvTest, ReadsTheProcessEnvironment) {
  const char* name = "FSDP_COMMON_TEST_VARIABLE";
  EnvLookup env = ProcessEnv();
  unsetenv(name);
  EXPECT_EQ(env(name), std::nullopt);
  setenv(name, "17", 1);
  EXPECT_THAT(env(name), Optional(std::string("17")));
  setenv(name, "", 1);
  EXPECT_EQ(env(name), std::nullopt) << "empty values count as unset";
  unsetenv(name);
}

TEST(GetIntEnvTest, ReadsIntegers) {
  EnvLookup env = MapEnv({{"N", "7"}, {"NEG", "-3"}, {"PADDED", " 12\t"}, {"ZERO", "0"}});
  EXPECT_THAT(GetIntEnv(env, "N"), IsOkAndHolds(7));
  EXPECT_THAT(GetIntEnv(env, "ZERO"), IsOkAndHolds(0));
  EXPECT_THAT(GetIntEnv(env, "PADDED"), IsOkAndHolds(12)) << "surrounding whitespace is stripped";
  EXPECT_THAT(GetIntEnv(env, "NEG", -5, 5), IsOkAndHolds(-3));
}

TEST(GetIntEnvTest, MissingIsAnErrorNamingTheVariable) {
  EnvLookup env = MapEnv({{"EMPTY", ""}});
  EXPECT_THAT(GetIntEnv(env, "RANK").status(),
              InvalidArgumentWith(HasSubstr("environment variable RANK is not set")));
  EXPECT_THAT(GetIntEnv(env, "EMPTY").status(),
              InvalidArgumentWith(HasSubstr("environment variable EMPTY is not set")));
}

TEST(GetIntEnvTest, RejectsNonIntegers) {
  for (const char* value : {"abc", "1.5", "4x", "+1", "0x10", "1 2", "99999999999"}) {
    EnvLookup env = MapEnv({{"RANK", value}});
    EXPECT_THAT(GetIntEnv(env, "RANK").status(),
                InvalidArgumentWith(AllOf(HasSubstr("environment variable RANK='"),
                                          HasSubstr(value), HasSubstr("' is not an integer"))))
        << value;
    EXPECT_THAT(GetOptionalIntEnv(env, "RANK").status(), InvalidArgumentWith(HasSubstr("RANK='")));
  }
}

TEST(GetIntEnvTest, ChecksTheInclusiveRange) {
  EnvLookup env = MapEnv({{"P", "0"},
                          {"Q", "65535"},
                          {"R", "65536"},
                          {"NEG", "-1"},
                          {"BIG", "1073741825"},
                          {"MAX", "1073741824"}});
  EXPECT_THAT(GetIntEnv(env, "P", 1, 65535).status(),
              InvalidArgumentWith(AllOf(HasSubstr("environment variable P=0 is out of range"),
                                        HasSubstr("valid: 1..65535"))));
  EXPECT_THAT(GetIntEnv(env, "Q", 1, 65535), IsOkAndHolds(65535));
  EXPECT_THAT(GetIntEnv(env, "R", 1, 65535).status(),
              InvalidArgumentWith(HasSubstr("R=65536 is out of range; valid: 1..65535")));
  EXPECT_THAT(GetIntEnv(env, "NEG").status(),
              InvalidArgumentWith(HasSubstr("NEG=-1 is out of range; valid: 0..1073741824")));
  EXPECT_THAT(GetIntEnv(env, "MAX"), IsOkAndHolds(1 << 30));
  EXPECT_THAT(GetIntEnv(env, "BIG").status(), InvalidArgumentWith(HasSubstr("BIG=1073741825")));
  EXPECT_THAT(GetIntEnv(env, "P", 0, 0), IsOkAndHolds(0));
}

TEST(GetOptionalIntEnvTest, UnsetIsNotAnError) {
  EnvLookup env = MapEnv({{"SET", "5"}, {"EMPTY", ""}});
  absl::StatusOr<std::optional<int>> set = GetOptionalIntEnv(env, "SET");
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_THAT(*set, Optional(5));
  for (const char* name : {"EMPTY", "MISSING"}) {
    absl::StatusOr<std::optional<int>> unset = GetOptionalIntEnv(env, name);
    ASSERT_TRUE(unset.ok()) << unset.status();
    EXPECT_EQ(*unset, std::nullopt) << name;
  }
  EXPECT_THAT(GetOptionalIntEnv(env, "SET", 6, 9).status(),
              InvalidArgumentWith(HasSubstr("SET=5 is out of range; valid: 6..9")));
}

// The one declaration of our environment knobs: unique names, each documented.
TEST(EnvKnobsTest, UniqueAndDescribed) {
  std::set<std::string_view> names;
  for (const EnvKnob& knob : AllEnvKnobs()) {
    SCOPED_TRACE(std::string(knob.name));
    EXPECT_TRUE(names.insert(knob.name).second) << "declared twice";
    EXPECT_FALSE(knob.name.empty());
    EXPECT_FALSE(knob.description.empty());
    EXPECT_FALSE(knob.default_value.empty());
    EXPECT_FALSE(knob.valid.empty());
    EXPECT_FALSE(knob.read_by.empty());
  }
  EXPECT_GE(names.size(), 8u);
}

TEST(EnvKnobsTest, GetEnvKnobReadsTheProcessEnvironment) {
  constexpr EnvKnob kProbe{"FSDP_ENV_KNOBS_TEST_PROBE", "d", "unset", "any", "tests"};
  ::unsetenv("FSDP_ENV_KNOBS_TEST_PROBE");
  EXPECT_EQ(GetEnvKnob(kProbe), std::nullopt);
  ::setenv("FSDP_ENV_KNOBS_TEST_PROBE", "", 1);
  EXPECT_EQ(GetEnvKnob(kProbe), "");
  ::setenv("FSDP_ENV_KNOBS_TEST_PROBE", "3", 1);
  EXPECT_EQ(GetEnvKnob(kProbe), "3");
  ::unsetenv("FSDP_ENV_KNOBS_TEST_PROBE");
}

}  // namespace
}  // namespace fsdp

// ---- Failure classes (common/failure.h) --------------------------------------------------------

namespace fsdp {
namespace {

TEST(FailureTest, ExitCodesAreDistinctPerClass) {
  std::set<int> codes;
  for (FailureClass c : {FailureClass::kError, FailureClass::kConfig, FailureClass::kCheckpoint,
                         FailureClass::kIo, FailureClass::kNonFinite,
                         FailureClass::kCollectiveTimeout, FailureClass::kPeerLost,
                         FailureClass::kInternal, FailureClass::kPreempted,
                         FailureClass::kOutOfMemory}) {
    EXPECT_TRUE(codes.insert(ExitCodeFor(c)).second) << FailureClassName(c);
    EXPECT_EQ(FailureClassOfExitCode(ExitCodeFor(c)), c) << FailureClassName(c);
  }
  EXPECT_EQ(ExitCodeFor(FailureClass::kConfig), 2);  // what config tests and scripts rely on
}

TEST(FailureTest, ClassFromStatusCodeUnlessRecorded) {
  EXPECT_EQ(ClassifyFailure(absl::InvalidArgumentError("x")), FailureClass::kConfig);
  EXPECT_EQ(ClassifyFailure(absl::DataLossError("x")), FailureClass::kCheckpoint);
  EXPECT_EQ(ClassifyFailure(absl::DeadlineExceededError("x")), FailureClass::kCollectiveTimeout);
  EXPECT_EQ(ClassifyFailure(absl::UnavailableError("x")), FailureClass::kPeerLost);
  EXPECT_EQ(ClassifyFailure(absl::InternalError("x")), FailureClass::kInternal);
  EXPECT_EQ(ClassifyFailure(absl::FailedPreconditionError("x")), FailureClass::kError);
  absl::Status marked =
      WithFailureClass(absl::FailedPreconditionError("step 3: NaN"), FailureClass::kNonFinite);
  EXPECT_EQ(ClassifyFailure(marked), FailureClass::kNonFinite);
  EXPECT_EQ(marked.message(), "step 3: NaN");
  EXPECT_TRUE(WithFailureClass(absl::OkStatus(), FailureClass::kIo).ok());
}

TEST(FailureTest, RecordsAreReadEarliestFirst) {
  std::string dir = ::testing::TempDir() + "/fsdp-failure-records";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/rank3.failure") << "200 7\nrank 3: peer lost: x\n";
  std::ofstream(dir + "/rank1.failure") << "100 3\nrank 1: checkpoint: f.bin\n";
  std::ofstream(dir + "/rank2.failure") << "garbage";
  std::ofstream(dir + "/notes.txt") << "1 1\nx\n";
  std::vector<FailureRecord> records = ReadFailureRecords(dir);
  ASSERT_EQ(records.size(), 2u);
  EXPECT_EQ(records[0].rank, 1);
  EXPECT_EQ(records[0].exit_code, 3);
  EXPECT_EQ(records[0].line, "rank 1: checkpoint: f.bin");
  EXPECT_EQ(records[1].rank, 3);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace fsdp
