// A strict YAML configuration read through a schema: sections of typed keys, each pointing at
// the member it sets. Knows no particular configuration (engine/run_schema.cc is the run's).
//
// What it gives a configuration: errors that name the file and line (or the --set item), the
// key path and what would be valid, with a did-you-mean for misspelt names; keys that were
// removed fail naming what replaces them; the resolved values print back as YAML scalars.
//
//   struct Opts { int64_t steps = 1; Color color = Color::kRed; };
//   const EnumNames<Color> kColors = {{Color::kRed, "red"}, {Color::kBlue, "blue"}};
//   Opts opts;
//   std::vector<Section> sections = {
//       {"run", {{"steps", &opts.steps}, {"color", Enum(&opts.color, kColors)}}}};
//   Parser parser("x.yaml", sections, /*removed=*/{}, "an options file");
//   Locations where;
//   FSDP_RETURN_IF_ERROR(parser.ParseDocument(text, where));   // x.yaml:3: run.stpes: ...
//   FSDP_RETURN_IF_ERROR(parser.ApplyOverride("run.steps=5", where));
//   Validator v(where, "x.yaml");
//   FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("run.steps", opts.steps, 1));
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include <yaml-cpp/yaml.h>

#include "absl/status/status.h"
#include "common/strings.h"

namespace fsdp {

// A key whose YAML string maps to a typed value (an enum or a small struct): `parse` returns
// nullopt on success or what is wrong ("'x' is not valid; valid: ..."); `print` gives it back
// for the resolved YAML.
struct ChoiceField {
  std::function<std::optional<std::string>(const std::string&)> parse;
  std::function<std::string()> print;
};

// A list of strings is a YAML sequence; a single string is a list of one.
using StringList = std::vector<std::string>;
using FieldRef = std::variant<int64_t*, double*, bool*, std::string*, ChoiceField, StringList*>;

struct Field {
  std::string_view name;
  FieldRef ref;
};

// The keys of one top-level map, in the order the resolved YAML writes them.
struct Section {
  std::string_view name;
  std::vector<Field> fields;
};

// A key that no longer exists ("section.key"), with what replaces it: an old file fails naming
// the new way.
struct RemovedKey {
  std::string_view key;
  std::string_view replacement;
};

// Where each key was set ("configs/x.yaml:12" or "--set training.steps=5"), by "section.key".
using Locations = std::map<std::string, std::string, std::less<>>;

// Optimal string alignment distance (Levenshtein plus adjacent transpositions), ignoring case.
size_t EditDistance(std::string_view a, std::string_view b);
// The closest candidate, if it is close: at most 2 edits (or a third of its length, for long
// names), and never more than half of it, so that "ab" does not suggest "lr".
std::optional<std::string> Suggest(std::string_view word, const std::vector<std::string>& valid);
// "unknown key; did you mean 'steps'? (valid: a, b)" or "unknown key (valid: a, b)".
std::string UnknownName(std::string_view what, std::string_view word,
                        const std::vector<std::string>& valid);
// "'fully_shard' is not valid; did you mean 'full_shard'? valid: a, b" (the suggestion if
// close); `valid_text` replaces the listed names when set.
std::string NotValid(std::string_view value, const std::vector<std::string>& valid,
                     std::string_view valid_text = {});

// Every spelling of an enum, written once, in the order "valid: ..." lists them: the parser's
// Enum() field and the enum's Name() function for messages and records both read it.
template <typename E>
class EnumNames {
 public:
  using Entry = std::pair<E, const char*>;

  EnumNames(std::initializer_list<Entry> entries) : entries_(entries) {}
  // The table of `values` named by `name_of` (names that live with the enum's own code); the
  // names must outlive the table (literals).
  template <typename NameOf>
  static EnumNames Of(const std::vector<E>& values, NameOf name_of) {
    EnumNames names;
    for (E value : values) names.entries_.emplace_back(value, name_of(value));
    return names;
  }

  // "?" for a value the table does not hold.
  const char* Name(const E& value) const {
    for (const auto& [v, name] : entries_) {
      if (v == value) return name;
    }
    return "?";
  }
  std::optional<E> Parse(std::string_view text) const {
    for (const auto& [v, name] : entries_) {
      if (text == name) return v;
    }
    return std::nullopt;
  }
  std::vector<std::string> Valid() const {
    std::vector<std::string> valid;
    for (const auto& entry : entries_) valid.emplace_back(entry.second);
    return valid;
  }

 private:
  EnumNames() = default;

  std::vector<Entry> entries_;
};

// A key spelled by one of `names`; the message on any other value lists them all.
template <typename E>
ChoiceField Enum(E* field, const EnumNames<E>& names) {
  return {[field, names](const std::string& text) -> std::optional<std::string> {
            std::optional<E> value = names.Parse(text);
            if (!value) return NotValid(text, names.Valid());
            *field = *value;
            return std::nullopt;
          },
          [field, names] { return std::string(names.Name(*field)); }};
}

// kInvalidArgument "WHERE: KEY: WHAT" ("WHERE: WHAT" without a key).
absl::Status Invalid(std::string_view where, std::string_view key, std::string_view what);
// "name:LINE", or the name alone where the mark is unknown.
std::string At(std::string_view name, const YAML::Mark& mark);
// A YAML value for messages: "a map", "a list", "'text'", "an empty value".
std::string Describe(const YAML::Node& node);
std::optional<int64_t> ToInt(std::string_view s);    // a leading '+' is allowed
std::optional<double> ToDouble(std::string_view s);  // finite only
// Sets the field from a YAML value; the message on a type error is "expected ..., got ...".
absl::Status SetField(const FieldRef& ref, const YAML::Node& value, std::string_view where,
                      std::string_view key);

// Reads a YAML document and `--set section.key=value` items into the sections' fields, noting
// where each key was set. `document` names what one document is, for the message on a file
// of several ("a run configuration").
class Parser {
 public:
  Parser(std::string name, std::vector<Section> sections, std::span<const RemovedKey> removed,
         std::string document);

  absl::Status ParseDocument(const std::string& text, Locations& where);
  absl::Status ApplyOverride(const std::string& item, Locations& where);

 private:
  absl::Status ParseSection(Section& section, const std::string& section_name,
                            const std::string& at, const YAML::Node& body, Locations& where);
  Section* FindSection(std::string_view name);
  // What replaces a removed key, or why the key is unknown.
  std::string UnknownKey(const Section& section, std::string_view path,
                         std::string_view field_name) const;
  std::vector<std::string> SectionNames() const;

  std::string name_;
  std::vector<Section> sections_;
  std::span<const RemovedKey> removed_;
  std::string document_;
};

// Value checks; each error is reported at the place its key was set, else where the first of
// `related` was set, else at the file name alone (a key left at its default).
class Validator {
 public:
  Validator(const Locations& where, std::string name) : where_(where), name_(std::move(name)) {}

  absl::Status Fail(std::string_view key, std::string_view what,
                    std::initializer_list<std::string_view> related = {}) const;
  absl::Status Check(bool ok, std::string_view key, std::string_view what,
                     std::initializer_list<std::string_view> related = {}) const {
    return ok ? absl::OkStatus() : Fail(key, what, related);
  }
  template <typename T>
  absl::Status AtLeast(std::string_view key, T value, T min) const {
    return Check(value >= min, key, StrCat("must be >= ", min, ", got ", value));
  }
  // Within float32's range: these values end up in fp32 arithmetic, where 1e300 is inf.
  absl::Status FitsFloat(std::string_view key, double value) const;
  absl::Status Positive(std::string_view key, double value) const;  // and FitsFloat
  absl::Status Fraction(std::string_view key, double value) const;  // in [0, 1)
  absl::Status OneOf(std::string_view key, const std::string& value,
                     const std::vector<std::string>& valid) const;

 private:
  std::string Where(std::string_view key, std::initializer_list<std::string_view> related) const;

  const Locations& where_;
  std::string name_;
};

// Shortest round-trip text, with a '.' so that every YAML reader types it as a float
// (1 -> 1.0, 1e-05 -> 1.0e-05).
std::string FormatDouble(double value);
// The field's value as the YAML text that reads back to it.
std::string YamlScalar(const FieldRef& ref);

}  // namespace fsdp
