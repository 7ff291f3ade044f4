#include "common/yaml_schema.h"

#include <algorithm>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <system_error>

#include "common/status.h"

namespace fsdp {
namespace {

template <typename T, typename GetName>
std::vector<std::string> Names(const std::vector<T>& items, GetName get_name) {
  std::vector<std::string> names;
  for (const T& item : items) names.emplace_back(get_name(item));
  return names;
}

std::vector<std::string> KeyNames(const Section& section) {
  return Names(section.fields, [](const Field& f) { return f.name; });
}

Field* FindField(Section& section, std::string_view name) {
  for (Field& field : section.fields) {
    if (field.name == name) return &field;
  }
  return nullptr;
}

absl::Status SetChoice(const ChoiceField& choice, const YAML::Node& value, std::string_view where,
                       std::string_view key) {
  if (!value.IsScalar()) {
    // What is valid, from the parser's own message for a value no field accepts.
    std::string valid;
    if (std::optional<std::string> e = choice.parse("\x7f"); e) {
      if (size_t at = e->rfind("valid: "); at != std::string::npos) valid = "; " + e->substr(at);
    }
    const bool key_value = value.IsMap() && value.size() == 1;
    return Invalid(where, key,
                   StrCat("expected a string, got ", Describe(value),
                          key_value ? " (YAML reads 'a: b' with a space after the colon as a "
                                      "map: write a:b)"
                                    : "",
                          valid));
  }
  if (std::optional<std::string> error = choice.parse(value.Scalar())) {
    return Invalid(where, key, *error);
  }
  return absl::OkStatus();
}

absl::Status SetList(StringList& list, const YAML::Node& value, std::string_view where,
                     std::string_view key) {
  StringList items;
  if (value.IsScalar()) items.push_back(value.Scalar());
  if (value.IsSequence()) {
    for (const YAML::Node& item : value) {
      if (!item.IsScalar()) {
        return Invalid(where, key,
                       StrCat("expected a list of strings, got an item that is ", Describe(item)));
      }
      items.push_back(item.Scalar());
    }
  } else if (!value.IsScalar() && !value.IsNull()) {
    return Invalid(where, key, StrCat("expected a list of strings, got ", Describe(value)));
  }
  list = std::move(items);
  return absl::OkStatus();
}

}  // namespace

size_t EditDistance(std::string_view a_in, std::string_view b_in) {
  std::string a = ToLower(a_in);
  std::string b = ToLower(b_in);
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

std::optional<std::string> Suggest(std::string_view word, const std::vector<std::string>& valid) {
  std::optional<std::string> best;
  size_t best_distance = SIZE_MAX;
  for (const std::string& candidate : valid) {
    size_t distance = EditDistance(word, candidate);
    bool close =
        distance <= std::max<size_t>(2, candidate.size() / 3) && 2 * distance <= candidate.size();
    if (close && distance < best_distance) {
      best = candidate;
      best_distance = distance;
    }
  }
  return best;
}

std::string UnknownName(std::string_view what, std::string_view word,
                        const std::vector<std::string>& valid) {
  std::optional<std::string> suggestion = Suggest(word, valid);
  if (suggestion) {
    return StrCat(what, "; did you mean '", *suggestion, "'? (valid: ", StrJoin(valid, ", "), ")");
  }
  return StrCat(what, " (valid: ", StrJoin(valid, ", "), ")");
}

std::string NotValid(std::string_view value, const std::vector<std::string>& valid,
                     std::string_view valid_text) {
  std::string listed = valid_text.empty() ? StrJoin(valid, ", ") : std::string(valid_text);
  std::optional<std::string> suggestion = Suggest(value, valid);
  if (suggestion) {
    return StrCat("'", value, "' is not valid; did you mean '", *suggestion, "'? valid: ", listed);
  }
  return StrCat("'", value, "' is not valid; valid: ", listed);
}

absl::Status Invalid(std::string_view where, std::string_view key, std::string_view what) {
  if (key.empty()) return absl::InvalidArgumentError(StrCat(where, ": ", what));
  return absl::InvalidArgumentError(StrCat(where, ": ", key, ": ", what));
}

std::string At(std::string_view name, const YAML::Mark& mark) {
  if (mark.is_null()) return std::string(name);
  return StrCat(name, ":", mark.line + 1);
}

std::string Describe(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Map:
      return "a map";
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Scalar:
      return StrCat("'", node.Scalar(), "'");
    default:
      return "an empty value";
  }
}

std::optional<int64_t> ToInt(std::string_view s) {
  if (StartsWith(s, "+")) s.remove_prefix(1);
  return ParseInt<int64_t>(s);
}

std::optional<double> ToDouble(std::string_view s) {
  if (StartsWith(s, "+")) s.remove_prefix(1);
  double value = 0;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (s.empty() || ec != std::errc() || ptr != s.data() + s.size() || !std::isfinite(value)) {
    return std::nullopt;
  }
  return value;
}

absl::Status SetField(const FieldRef& ref, const YAML::Node& value, std::string_view where,
                      std::string_view key) {
  bool scalar = value.IsScalar();
  if (auto* choice = std::get_if<ChoiceField>(&ref)) return SetChoice(*choice, value, where, key);
  if (auto* list = std::get_if<StringList*>(&ref)) return SetList(**list, value, where, key);
  if (auto* s = std::get_if<std::string*>(&ref)) {
    if (!scalar && !value.IsNull()) {
      return Invalid(where, key, StrCat("expected a string, got ", Describe(value)));
    }
    **s = value.IsNull() ? "" : value.Scalar();
    return absl::OkStatus();
  }
  if (auto* i = std::get_if<int64_t*>(&ref)) {
    std::optional<int64_t> parsed = scalar ? ToInt(value.Scalar()) : std::nullopt;
    if (!parsed) return Invalid(where, key, StrCat("expected an integer, got ", Describe(value)));
    **i = *parsed;
    return absl::OkStatus();
  }
  if (auto* d = std::get_if<double*>(&ref)) {
    std::optional<double> parsed = scalar ? ToDouble(value.Scalar()) : std::nullopt;
    if (!parsed) return Invalid(where, key, StrCat("expected a number, got ", Describe(value)));
    **d = *parsed;
    return absl::OkStatus();
  }
  bool* b = std::get<bool*>(ref);
  if (!scalar || (value.Scalar() != "true" && value.Scalar() != "false")) {
    return Invalid(where, key, StrCat("expected true or false, got ", Describe(value)));
  }
  *b = value.Scalar() == "true";
  return absl::OkStatus();
}

Parser::Parser(std::string name, std::vector<Section> sections, std::span<const RemovedKey> removed,
               std::string document)
    : name_(std::move(name)),
      sections_(std::move(sections)),
      removed_(removed),
      document_(std::move(document)) {}

absl::Status Parser::ParseDocument(const std::string& text, Locations& where) {
  YAML::Node root;
  try {
    // One document: a second one ("---") would otherwise be silently ignored.
    std::vector<YAML::Node> documents = YAML::LoadAll(text);
    if (documents.size() > 1) {
      return Invalid(At(name_, documents[1].Mark()), "",
                     StrCat("the file holds ", documents.size(), " YAML documents ('---'); ",
                            document_, " is one document"));
    }
    root = YAML::Load(text);
  } catch (const YAML::ParserException& e) {
    return Invalid(At(name_, e.mark), "", StrCat("YAML syntax error: ", e.msg));
  } catch (const YAML::Exception& e) {
    return Invalid(name_, "", StrCat("cannot read YAML: ", e.what()));
  }
  if (root.IsNull()) return absl::OkStatus();
  if (!root.IsMap()) {
    return Invalid(At(name_, root.Mark()), "",
                   StrCat("expected a map of sections (", StrJoin(SectionNames(), ", "), "), got ",
                          Describe(root)));
  }
  std::map<std::string, std::string> section_at;
  for (const auto& entry : root) {
    const YAML::Node& key = entry.first;
    std::string section_name = key.IsScalar() ? key.Scalar() : Describe(key);
    std::string at = At(name_, key.Mark());
    Section* section = FindSection(section_name);
    if (section == nullptr) {
      return Invalid(at, section_name,
                     UnknownName("unknown section", section_name, SectionNames()));
    }
    auto [first, inserted] = section_at.emplace(section_name, at);
    if (!inserted) {
      return Invalid(at, section_name, StrCat("duplicate section (first at ", first->second, ")"));
    }
    FSDP_RETURN_IF_ERROR(ParseSection(*section, section_name, at, entry.second, where));
  }
  return absl::OkStatus();
}

absl::Status Parser::ParseSection(Section& section, const std::string& section_name,
                                  const std::string& at, const YAML::Node& body, Locations& where) {
  if (body.IsNull()) return absl::OkStatus();
  if (!body.IsMap()) {
    return Invalid(at, section_name,
                   StrCat("expected a map of keys, got ", Describe(body),
                          " (valid: ", StrJoin(KeyNames(section), ", "), ")"));
  }
  for (const auto& item : body) {
    const YAML::Node& field_key = item.first;
    std::string field_name = field_key.IsScalar() ? field_key.Scalar() : Describe(field_key);
    std::string path = StrCat(section_name, ".", field_name);
    std::string field_at = At(name_, field_key.Mark());
    Field* field = FindField(section, field_name);
    if (field == nullptr) return Invalid(field_at, path, UnknownKey(section, path, field_name));
    if (where.count(path) > 0) {
      return Invalid(field_at, path, StrCat("duplicate key (first at ", where[path], ")"));
    }
    FSDP_RETURN_IF_ERROR(SetField(field->ref, item.second, field_at, path));
    where[path] = field_at;
  }
  return absl::OkStatus();
}

absl::Status Parser::ApplyOverride(const std::string& item, Locations& where) {
  std::string at = StrCat("--set ", item);
  size_t eq = item.find('=');
  std::string_view path =
      eq == std::string::npos ? "" : Strip(std::string_view(item).substr(0, eq));
  size_t dot = path.find('.');
  if (eq == std::string::npos || dot == std::string_view::npos || dot == 0 ||
      dot + 1 == path.size()) {
    return Invalid(at, "", "expected section.key=value (e.g. training.steps=100)");
  }
  std::string section_name(path.substr(0, dot));
  std::string field_name(path.substr(dot + 1));
  Section* section = FindSection(section_name);
  if (section == nullptr) {
    return Invalid(at, section_name, UnknownName("unknown section", section_name, SectionNames()));
  }
  std::string key = StrCat(section_name, ".", field_name);
  Field* field = FindField(*section, field_name);
  if (field == nullptr) return Invalid(at, key, UnknownKey(*section, key, field_name));
  YAML::Node value;
  try {
    value = YAML::Load(std::string(Strip(std::string_view(item).substr(eq + 1))));
  } catch (const YAML::Exception& e) {
    return Invalid(at, key, StrCat("cannot parse the value as YAML: ", e.msg));
  }
  FSDP_RETURN_IF_ERROR(SetField(field->ref, value, at, key));
  where[key] = at;
  return absl::OkStatus();
}

Section* Parser::FindSection(std::string_view name) {
  for (Section& section : sections_) {
    if (section.name == name) return &section;
  }
  return nullptr;
}

std::string Parser::UnknownKey(const Section& section, std::string_view path,
                               std::string_view field_name) const {
  for (const RemovedKey& removed : removed_) {
    if (removed.key == path) return std::string(removed.replacement);
  }
  return UnknownName("unknown key", field_name, KeyNames(section));
}

std::vector<std::string> Parser::SectionNames() const {
  return Names(sections_, [](const Section& s) { return s.name; });
}

absl::Status Validator::Fail(std::string_view key, std::string_view what,
                             std::initializer_list<std::string_view> related) const {
  return Invalid(Where(key, related), key, what);
}

// Found by the red-team pass: model.init_std 1e300 trained into a NaN at step 1, and
// training.max_grad_norm 1e300 failed inside ATen's clipping with an internal error.
absl::Status Validator::FitsFloat(std::string_view key, double value) const {
  return Check(std::abs(value) <= std::numeric_limits<float>::max(), key,
               StrCat("must be at most float32's largest value (3.4e38), got ", value));
}

absl::Status Validator::Positive(std::string_view key, double value) const {
  FSDP_RETURN_IF_ERROR(Check(value > 0, key, StrCat("must be > 0, got ", value)));
  return FitsFloat(key, value);
}

absl::Status Validator::Fraction(std::string_view key, double value) const {
  return Check(value >= 0 && value < 1, key, StrCat("must be in [0, 1), got ", value));
}

absl::Status Validator::OneOf(std::string_view key, const std::string& value,
                              const std::vector<std::string>& valid) const {
  bool ok = std::find(valid.begin(), valid.end(), value) != valid.end();
  return Check(ok, key, NotValid(value, valid));
}

std::string Validator::Where(std::string_view key,
                             std::initializer_list<std::string_view> related) const {
  if (auto it = where_.find(key); it != where_.end()) return it->second;
  for (std::string_view other : related) {
    if (auto it = where_.find(other); it != where_.end()) return it->second;
  }
  return name_;
}

std::string FormatDouble(double value) {
  std::string text = fmt::format("{}", value);
  if (text.find('.') == std::string::npos) {
    size_t exponent = text.find('e');
    text.insert(exponent == std::string::npos ? text.size() : exponent, ".0");
  }
  return text;
}

std::string YamlScalar(const FieldRef& ref) {
  if (auto* i = std::get_if<int64_t*>(&ref)) return StrCat(**i);
  if (auto* d = std::get_if<double*>(&ref)) return FormatDouble(**d);
  if (auto* b = std::get_if<bool*>(&ref)) return **b ? "true" : "false";
  YAML::Emitter out;
  if (auto* choice = std::get_if<ChoiceField>(&ref)) {
    out << choice->print();
    return out.c_str();
  }
  if (auto* list = std::get_if<StringList*>(&ref)) {
    out << YAML::Flow << **list;  // ["tok_embeddings.*", "layers.0.*"], or []
    return out.c_str();
  }
  out << *std::get<std::string*>(ref);
  return out.c_str();
}

}  // namespace fsdp
