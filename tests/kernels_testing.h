// Shared by tests/kernels_*_test.cc: devices to run on, and a closeness check that reports the
// worst element.
#pragma once

#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "tests/gpu_skip.h"

namespace fsdp::kernels::testing {

// |actual - expected| <= atol + rtol * |expected| elementwise (compared in fp64); on failure
// the message names `what`, the worst index, both values and the max difference.
inline ::testing::AssertionResult AllClose(const at::Tensor& actual, const at::Tensor& expected,
                                           double rtol, double atol, const std::string& what) {
  if (actual.sizes() != expected.sizes()) {
    return ::testing::AssertionFailure() << what << ": shape " << actual.sizes() << " vs "
                                         << expected.sizes();
  }
  at::Tensor a = actual.detach().to(at::kCPU, at::kDouble);
  at::Tensor e = expected.detach().to(at::kCPU, at::kDouble);
  if (a.numel() == 0) return ::testing::AssertionSuccess();
  at::Tensor excess = (a - e).abs() - (atol + rtol * e.abs());
  at::Tensor worst = excess.flatten().argmax();
  double worst_excess = excess.flatten()[worst.item<int64_t>()].item<double>();
  if (!(worst_excess <= 0) || !a.isfinite().all().item<bool>()) {
    int64_t i = worst.item<int64_t>();
    return ::testing::AssertionFailure()
           << what << ": element " << i << " is " << a.flatten()[i].item<double>()
           << ", expected " << e.flatten()[i].item<double>() << " (rtol " << rtol << ", atol "
           << atol << "; max |diff| " << (a - e).abs().max().item<double>() << ")";
  }
  return ::testing::AssertionSuccess();
}

}  // namespace fsdp::kernels::testing
