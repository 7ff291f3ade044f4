// Internal to checkpoint/: typed, validating access to JSON fields for the metadata and rank
// manifest schemas. Every error is kDataLoss "SOURCE: PATH: what", PATH the field's path
// ("tensors[3].chunks[0].nbytes"), so a corrupt file or message names what is wrong where.
//
//   JsonReader in("step_000000120/metadata.json");
//   FSDP_ASSIGN_OR_RETURN(int64_t step, in.IntField(json, "", "step", /*min=*/0));
//   FSDP_ASSIGN_OR_RETURN(const nlohmann::json* mesh,
//                         in.TypedField(json, "", "mesh", nlohmann::json::value_t::object));
//   FSDP_ASSIGN_OR_RETURN(std::string axis0, in.StringField(*mesh, "mesh.", "axis0"));
#pragma once

#include <cstdint>
#include <limits>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/status.h"
#include "common/strings.h"

namespace fsdp::ckpt {

// `path` arguments are the field's parent path including its trailing "." ("" at the root);
// the key is appended. Holds `source` by reference: it must outlive the reader.
class JsonReader {
 public:
  explicit JsonReader(const std::string& source) : source_(source) {}

  absl::Status Error(const std::string& path, const std::string& what) const {
    return absl::DataLossError(StrCat(source_, ": ", path, ": ", what));
  }

  absl::StatusOr<const nlohmann::json*> Field(const nlohmann::json& obj, const std::string& path,
                                              const char* key) const {
    auto it = obj.find(key);
    if (it == obj.end()) return Error(path, "missing");
    return &*it;
  }
  absl::StatusOr<int64_t> Int(const nlohmann::json& v, const std::string& path, int64_t min,
                              int64_t max = std::numeric_limits<int64_t>::max()) const {
    int64_t x = 0;
    if (v.is_number_integer() && !v.is_number_unsigned()) {
      x = v.get<int64_t>();
    } else if (v.is_number_unsigned()) {
      uint64_t u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Error(path, StrCat(u, " is out of range"));
      }
      x = static_cast<int64_t>(u);
    } else {
      return Error(path, StrCat("expected an integer, got ", v.type_name()));
    }
    if (x < min || x > max)
      return Error(path, StrCat(x, " is out of range [", min, ", ", max, "]"));
    return x;
  }
  absl::StatusOr<int64_t> IntField(const nlohmann::json& obj, const std::string& path,
                                   const char* key, int64_t min,
                                   int64_t max = std::numeric_limits<int64_t>::max()) const {
    std::string p = StrCat(path, key);
    FSDP_ASSIGN_OR_RETURN(const nlohmann::json* v, Field(obj, p, key));
    return Int(*v, p, min, max);
  }
  absl::StatusOr<std::string> StringField(const nlohmann::json& obj, const std::string& path,
                                          const char* key) const {
    std::string p = StrCat(path, key);
    FSDP_ASSIGN_OR_RETURN(const nlohmann::json* v, Field(obj, p, key));
    if (!v->is_string()) return Error(p, StrCat("expected a string, got ", v->type_name()));
    return v->get<std::string>();
  }
  absl::StatusOr<const nlohmann::json*> TypedField(const nlohmann::json& obj,
                                                   const std::string& path, const char* key,
                                                   nlohmann::json::value_t type) const {
    std::string p = StrCat(path, key);
    FSDP_ASSIGN_OR_RETURN(const nlohmann::json* v, Field(obj, p, key));
    if (v->type() != type) {
      const char* want = type == nlohmann::json::value_t::array ? "an array" : "an object";
      return Error(p, StrCat("expected ", want, ", got ", v->type_name()));
    }
    return v;
  }

 private:
  const std::string& source_;
};

}  // namespace fsdp::ckpt
