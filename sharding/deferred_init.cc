#include "sharding/deferred_init.h"

#include <cmath>

#include <ATen/ATen.h>

namespace fsdp {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t HashName(const std::string& name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return h;
}

// Uniform in (0, 1) from a 64-bit hash: 53 bits, never exactly 0.
double Unit(uint64_t bits) { return (static_cast<double>(bits >> 11) + 0.5) / 9007199254740992.0; }

double Value(const InitSpec& spec, uint64_t key, int64_t index) {
  switch (spec.kind) {
    case InitSpec::Kind::kConstant:
      return spec.a;
    case InitSpec::Kind::kUniform:
      return spec.a + (spec.b - spec.a) * Unit(SplitMix64(key ^ static_cast<uint64_t>(index)));
    case InitSpec::Kind::kNormal: {
      uint64_t h = SplitMix64(key ^ static_cast<uint64_t>(index));
      double u1 = Unit(h), u2 = Unit(SplitMix64(h));
      return spec.a + spec.b * std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
    }
  }
  return 0;
}

void Fill(const InitSpec& spec, uint64_t key, int64_t first_element, at::Tensor& out) {
  at::Tensor values = at::empty({out.numel()}, at::kDouble);
  double* data = values.data_ptr<double>();
  for (int64_t i = 0; i < out.numel(); ++i) data[i] = Value(spec, key, first_element + i);
  out.copy_(values.view(out.sizes()));
}

}  // namespace

at::Tensor DeferredTensor(const std::vector<int64_t>& shape, c10::TensorOptions options) {
  // Metadata only: the sizes are set on a tensor whose storage stays empty (no bounds check).
  at::Tensor t = at::empty({0}, options);
  t.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
  return t;
}

bool IsDeferred(const at::Tensor& t) {
  return t.numel() > 0 &&
         t.storage().nbytes() < static_cast<size_t>(t.numel()) * t.element_size();
}

ParamInitFn SeededInit(uint64_t seed, std::function<InitSpec(const std::string& name)> spec_of) {
  return [seed, spec_of](const std::string& name, int64_t first_row, int64_t row_numel,
                         at::Tensor& rows) {
    Fill(spec_of(name), SplitMix64(seed ^ HashName(name)), first_row * row_numel, rows);
  };
}

at::Tensor SeededFull(uint64_t seed, const std::string& name, const std::vector<int64_t>& shape,
                      const InitSpec& spec) {
  at::Tensor full = at::empty(shape, at::kFloat);
  Fill(spec, SplitMix64(seed ^ HashName(name)), 0, full);
  return full;
}

}  // namespace fsdp
