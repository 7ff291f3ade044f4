// Status helpers shared by every layer.
//
// Functions that take user input (config, mesh degrees, environment, CLI, files) return
// absl::Status / absl::StatusOr<T>. These macros keep call sites short:
//
//   absl::StatusOr<int> ParseDegree(std::string_view s);
//   absl::Status Build() {
//     FSDP_ASSIGN_OR_RETURN(int degree, ParseDegree("4"));
//     FSDP_RETURN_IF_ERROR(Validate(degree));
//     return absl::OkStatus();
//   }
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define FSDP_STATUS_CONCAT_INNER(a, b) a##b
#define FSDP_STATUS_CONCAT(a, b) FSDP_STATUS_CONCAT_INNER(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define FSDP_RETURN_IF_ERROR(expr)                  \
  do {                                              \
    ::absl::Status fsdp_status_ = (expr);           \
    if (!fsdp_status_.ok()) return fsdp_status_;    \
  } while (false)

// `lhs = value of expr` (an absl::StatusOr<T>), or returns its error status.
#define FSDP_ASSIGN_OR_RETURN(lhs, expr) \
  FSDP_ASSIGN_OR_RETURN_IMPL(FSDP_STATUS_CONCAT(fsdp_statusor_, __LINE__), lhs, expr)
#define FSDP_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return std::move(tmp).status();   \
  lhs = std::move(tmp).value()
