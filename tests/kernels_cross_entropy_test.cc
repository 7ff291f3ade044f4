// kernels::LinearCrossEntropy against cross_entropy(linear(hidden, weight).float(), targets)
// in ATen ops (the trainer's loss): loss and the gradients of hidden and weight, fp32 (tight)
// and bf16 (against the same composite in bf16), chunks that do not divide N, one chunk, odd
// vocab sizes, ignored rows, a tied embedding, a non-1 incoming gradient, no-grad use, bad
// targets. CPU reference always; CUDA kernel with a GPU.
#include "kernels/cross_entropy.h"

#include <algorithm>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tests/kernels_testing.h"

namespace fsdp::kernels {
namespace {

using testing::AllClose;

struct Case {
  int64_t n, d, vocab, chunk;
  at::ScalarType dtype;
  int64_t ignored;  // rows whose target is kIgnoreIndex (every 3rd row from the start)
};

struct Inputs {
  at::Tensor hidden, weight, targets;
};

Inputs MakeInputs(const Case& c, c10::Device device) {
  torch::manual_seed(5);
  Inputs in;
  in.hidden = torch::randn({c.n, c.d}).to(device, c.dtype);
  in.weight = (torch::randn({c.vocab, c.d}) * 0.5).to(device, c.dtype);
  at::Tensor targets = torch::randint(0, c.vocab, {c.n}, torch::kLong);
  for (int64_t i = 0; i < c.ignored; ++i) targets[(3 * i) % c.n] = kIgnoreIndex;
  in.targets = targets.to(device);
  return in;
}

// Tolerances: fp32 tight; bf16 against the composite run on the same bf16 tensors (logits
// rounded to bf16 alike, the loss in fp32 alike; the gradients differ by bf16 roundings of
// d logits and the GEMMs' outputs, and by our fp32 accumulation of grad_weight across chunks).
struct Tolerance {
  double loss_rtol, grad_rtol, grad_atol_of_max;
};

Tolerance TolFor(at::ScalarType dtype) {
  return dtype == at::kFloat ? Tolerance{1e-5, 1e-5, 1e-5} : Tolerance{1e-4, 1e-2, 1e-2};
}

void CheckAgainstComposite(const Case& c, c10::Device device, double grad_output = 1.0) {
  SCOPED_TRACE(::testing::Message()
               << "N " << c.n << " D " << c.d << " V " << c.vocab << " chunk " << c.chunk << " "
               << c.dtype << " ignored " << c.ignored << " grad_output " << grad_output);
  Inputs in = MakeInputs(c, device);
  Tolerance tol = TolFor(c.dtype);
  at::Tensor h = in.hidden.clone().requires_grad_(true);
  at::Tensor w = in.weight.clone().requires_grad_(true);
  at::Tensor loss = LinearCrossEntropy(h, w, in.targets, c.chunk);
  EXPECT_EQ(loss.scalar_type(), at::kFloat);
  EXPECT_EQ(loss.dim(), 0);
  (loss * grad_output).backward();

  at::Tensor hr = in.hidden.clone().requires_grad_(true);
  at::Tensor wr = in.weight.clone().requires_grad_(true);
  at::Tensor loss_ref = LinearCrossEntropyComposite(hr, wr, in.targets);
  (loss_ref * grad_output).backward();

  EXPECT_TRUE(AllClose(loss, loss_ref, tol.loss_rtol, 1e-6, "loss"));
  ASSERT_TRUE(h.grad().defined() && w.grad().defined());
  EXPECT_EQ(h.grad().scalar_type(), c.dtype);
  EXPECT_EQ(w.grad().scalar_type(), c.dtype);
  auto atol = [&](const at::Tensor& ref) {
    return tol.grad_atol_of_max * ref.abs().max().item<double>();
  };
  EXPECT_TRUE(AllClose(h.grad(), hr.grad(), tol.grad_rtol, atol(hr.grad()), "grad of hidden"));
  EXPECT_TRUE(AllClose(w.grad(), wr.grad(), tol.grad_rtol, atol(wr.grad()), "grad of weight"));
}

std::vector<Case> Cases() {
  return {
      {37, 16, 97, 8, at::kFloat, 0},        // chunk does not divide N, V odd
      {37, 16, 97, 8, at::kFloat, 5},        // ignored rows, one of them in the last chunk
      {64, 32, 1000, 64, at::kFloat, 0},     // chunk == N
      {50, 24, 1000, 4096, at::kFloat, 3},   // chunk > N: one chunk
      {9, 8, 1, 2, at::kFloat, 0},           // V = 1: loss 0, gradient 0
      {5, 8, 33, 1, at::kFloat, 1},          // one row per chunk
      {50, 24, 1000, 16, at::kBFloat16, 4},  // fp32 accumulation of grad_weight over chunks
      {37, 16, 97, 64, at::kBFloat16, 0},    // bf16, one chunk
      {64, 64, 1024, 24, at::kBFloat16, 2},  // V a multiple of 8 (the vector loads on CUDA)
  };
}

// Real vocabulary sizes: the CUDA kernel's 512 threads each own many elements of a row (the
// cases above give most threads one element or none), GPT-2's odd V takes the scalar loads and
// Llama's V the 16-byte vector loads with several vectors per thread; N is not a multiple of
// the chunk; bf16 and fp16 over several chunks accumulate grad_weight in fp32 (on CUDA through
// addmm with out_dtype float), fp32 through addmm_ into grad_weight itself.
std::vector<Case> LargeVocabCases() {
  return {
      {300, 64, 50257, 128, at::kBFloat16, 7},  // GPT-2 V: scalar loads; chunks 128, 128, 44
      {260, 64, 32000, 96, at::kBFloat16, 5},   // Llama V: vector loads; chunks 96, 96, 68
      {130, 32, 50257, 64, at::kHalf, 3},       // fp16 through the fp32 accumulator
      {70, 32, 32003, 32, at::kFloat, 2},       // fp32, odd V, grad_weight accumulated in place
  };
}

TEST(KernelsCrossEntropyTest, CpuMatchesComposite) {
  for (const Case& c : Cases()) CheckAgainstComposite(c, c10::kCPU);
}

TEST(KernelsCrossEntropyTest, CpuLargeVocabMatchesComposite) {
  for (const Case& c : LargeVocabCases()) CheckAgainstComposite(c, c10::kCPU);
}

TEST(KernelsCrossEntropyTest, CudaMatchesComposite) {
  FSDP_SKIP_WITHOUT_GPU();
  for (const Case& c : Cases()) CheckAgainstComposite(c, c10::Device(c10::kCUDA, 0));
}

TEST(KernelsCrossEntropyTest, CudaLargeVocabMatchesComposite) {
  FSDP_SKIP_WITHOUT_GPU();
  for (const Case& c : LargeVocabCases()) CheckAgainstComposite(c, c10::Device(c10::kCUDA, 0));
}

// The ATen call Note [addmm with out_dtype] (kernels/cross_entropy.cc) reads as valid in torch
// 2.11: bf16 and fp16 products added into an fp32 C in place, beta 0 (C not read: it holds
// NaN here) then beta 1, against the same sums in fp64.
TEST(KernelsCrossEntropyTest, CudaAddmmOutDtypeAddsIntoFp32) {
  FSDP_SKIP_WITHOUT_GPU();
  c10::Device cuda(c10::kCUDA, 0);
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(::testing::Message() << dtype);
    torch::manual_seed(21);
    at::Tensor a1 = torch::randn({97, 33}).to(cuda, dtype);
    at::Tensor b1 = torch::randn({33, 65}).to(cuda, dtype);
    at::Tensor a2 = torch::randn({97, 40}).to(cuda, dtype);
    at::Tensor b2 = torch::randn({40, 65}).to(cuda, dtype);
    at::Tensor acc = torch::full({97, 65}, NAN, torch::TensorOptions().device(cuda));
    at::addmm_out(acc, acc, a1, b1, at::kFloat, /*beta=*/0, /*alpha=*/1);
    at::addmm_out(acc, acc, a2, b2, at::kFloat, /*beta=*/1, /*alpha=*/1);
    EXPECT_EQ(acc.scalar_type(), at::kFloat);
    at::Tensor expected = at::mm(a1.to(at::kDouble), b1.to(at::kDouble)) +
                          at::mm(a2.to(at::kDouble), b2.to(at::kDouble));
    EXPECT_TRUE(AllClose(acc, expected, 1e-5, 1e-4, "fp32 accumulation of two products"));
  }
}

// loss * 3: the backward scales the kept gradients by the incoming one.
TEST(KernelsCrossEntropyTest, CpuScalesByIncomingGradient) {
  CheckAgainstComposite({37, 16, 97, 8, at::kFloat, 2}, c10::kCPU, 3.0);
  CheckAgainstComposite({37, 16, 97, 8, at::kBFloat16, 2}, c10::kCPU, -0.5);
}

TEST(KernelsCrossEntropyTest, CudaScalesByIncomingGradient) {
  FSDP_SKIP_WITHOUT_GPU();
  CheckAgainstComposite({37, 16, 97, 8, at::kFloat, 2}, c10::Device(c10::kCUDA, 0), 3.0);
  CheckAgainstComposite({37, 16, 97, 8, at::kBFloat16, 2}, c10::Device(c10::kCUDA, 0), -0.5);
}

// As ATen: every row ignored gives loss nan and zero gradients.
void CheckAllIgnored(c10::Device device) {
  Case c{12, 8, 19, 5, at::kFloat, 0};
  Inputs in = MakeInputs(c, device);
  in.targets.fill_(kIgnoreIndex);
  at::Tensor h = in.hidden.clone().requires_grad_(true);
  at::Tensor w = in.weight.clone().requires_grad_(true);
  at::Tensor loss = LinearCrossEntropy(h, w, in.targets, c.chunk);
  loss.backward();
  at::Tensor hr = in.hidden.clone().requires_grad_(true);
  at::Tensor wr = in.weight.clone().requires_grad_(true);
  at::Tensor loss_ref = LinearCrossEntropyComposite(hr, wr, in.targets);
  loss_ref.backward();
  EXPECT_TRUE(std::isnan(loss_ref.item<float>()));  // ATen's behaviour, which we match
  EXPECT_TRUE(std::isnan(loss.item<float>()));
  EXPECT_TRUE(at::equal(h.grad(), hr.grad()));
  EXPECT_TRUE(at::equal(w.grad(), wr.grad()));
  EXPECT_EQ(h.grad().abs().max().item<float>(), 0.0f);
}

TEST(KernelsCrossEntropyTest, CpuAllIgnoredIsNanWithZeroGradients) { CheckAllIgnored(c10::kCPU); }

TEST(KernelsCrossEntropyTest, CudaAllIgnoredIsNanWithZeroGradients) {
  FSDP_SKIP_WITHOUT_GPU();
  CheckAllIgnored(c10::Device(c10::kCUDA, 0));
}

// Tied embedding: the head's weight is also the input embedding; its two gradients add up.
void CheckTiedEmbedding(at::ScalarType dtype, c10::Device device) {
  SCOPED_TRACE(::testing::Message() << dtype);
  torch::manual_seed(9);
  const int64_t n = 29, d = 16, vocab = 97;
  at::Tensor table0 = (torch::randn({vocab, d}) * 0.5).to(device, dtype);
  at::Tensor mix0 = (torch::randn({d, d}) / 4).to(device, dtype);
  at::Tensor tokens = torch::randint(0, vocab, {n}, torch::kLong).to(device);
  at::Tensor targets = torch::randint(0, vocab, {n}, torch::kLong).to(device);
  auto run = [&](bool fused) {
    at::Tensor table = table0.clone().requires_grad_(true);
    at::Tensor mix = mix0.clone().requires_grad_(true);
    at::Tensor hidden = at::tanh(at::linear(at::embedding(table, tokens), mix));
    at::Tensor loss = fused ? LinearCrossEntropy(hidden, table, targets, 8)
                            : LinearCrossEntropyComposite(hidden, table, targets);
    loss.backward();
    return std::make_tuple(loss, table.grad(), mix.grad());
  };
  auto [loss, table_grad, mix_grad] = run(true);
  auto [loss_ref, table_grad_ref, mix_grad_ref] = run(false);
  Tolerance tol = TolFor(dtype);
  EXPECT_TRUE(AllClose(loss, loss_ref, tol.loss_rtol, 1e-6, "loss"));
  EXPECT_TRUE(AllClose(table_grad, table_grad_ref, tol.grad_rtol,
                       tol.grad_atol_of_max * table_grad_ref.abs().max().item<double>(),
                       "grad of the tied table"));
  EXPECT_TRUE(AllClose(mix_grad, mix_grad_ref, tol.grad_rtol,
                       tol.grad_atol_of_max * mix_grad_ref.abs().max().item<double>(),
                       "grad of the layer before the head"));
}

TEST(KernelsCrossEntropyTest, CpuTiedEmbeddingGradientsAdd) {
  CheckTiedEmbedding(at::kFloat, c10::kCPU);
  CheckTiedEmbedding(at::kBFloat16, c10::kCPU);
}

TEST(KernelsCrossEntropyTest, CudaTiedEmbeddingGradientsAdd) {
  FSDP_SKIP_WITHOUT_GPU();
  CheckTiedEmbedding(at::kFloat, c10::Device(c10::kCUDA, 0));
  CheckTiedEmbedding(at::kBFloat16, c10::Device(c10::kCUDA, 0));
}

// Without a gradient to compute (NoGradGuard, or no input requires grad) only the loss.
TEST(KernelsCrossEntropyTest, NoGradGivesTheLossOnly) {
  Case c{37, 16, 97, 8, at::kFloat, 3};
  Inputs in = MakeInputs(c, c10::kCPU);
  at::Tensor expected = LinearCrossEntropyComposite(in.hidden, in.weight, in.targets);
  at::Tensor plain = LinearCrossEntropy(in.hidden, in.weight, in.targets, c.chunk);
  EXPECT_FALSE(plain.requires_grad());
  EXPECT_TRUE(AllClose(plain, expected, 1e-5, 1e-6, "loss, inputs without grad"));
  at::Tensor h = in.hidden.clone().requires_grad_(true);
  torch::NoGradGuard no_grad;
  at::Tensor guarded = LinearCrossEntropy(h, in.weight, in.targets, c.chunk);
  EXPECT_FALSE(guarded.requires_grad());
  EXPECT_TRUE(AllClose(guarded, expected, 1e-5, 1e-6, "loss under NoGradGuard"));
}

// A frozen head: only hidden's gradient is computed and returned.
TEST(KernelsCrossEntropyTest, OnlyHiddenRequiresGrad) {
  Case c{37, 16, 97, 8, at::kFloat, 0};
  Inputs in = MakeInputs(c, c10::kCPU);
  at::Tensor h = in.hidden.clone().requires_grad_(true);
  LinearCrossEntropy(h, in.weight, in.targets, c.chunk).backward();
  at::Tensor hr = in.hidden.clone().requires_grad_(true);
  LinearCrossEntropyComposite(hr, in.weight, in.targets).backward();
  EXPECT_FALSE(in.weight.grad().defined());
  EXPECT_TRUE(AllClose(h.grad(), hr.grad(), 1e-4, 1e-7, "grad of hidden"));
}

TEST(KernelsCrossEntropyTest, OutOfRangeTargetNamesItAndV) {
  Case c{6, 8, 19, 4, at::kFloat, 0};
  Inputs in = MakeInputs(c, c10::kCPU);
  in.targets[4] = 19;
  EXPECT_THAT([&] { LinearCrossEntropy(in.hidden, in.weight, in.targets, 4); },
              ::testing::ThrowsMessage<c10::Error>(::testing::AllOf(
                  ::testing::HasSubstr("target 19 of row 4"), ::testing::HasSubstr("V = 19"))));
  in.targets[4] = -5;
  EXPECT_THAT([&] { LinearCrossEntropy(in.hidden, in.weight, in.targets, 4); },
              ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr("target -5 of row 4")));
}

TEST(KernelsCrossEntropyTest, RejectsBadArguments) {
  Case c{6, 8, 19, 4, at::kFloat, 0};
  Inputs in = MakeInputs(c, c10::kCPU);
  EXPECT_THROW(LinearCrossEntropy(in.hidden, in.weight, in.targets, 0), c10::Error);
  EXPECT_THROW(LinearCrossEntropy(in.hidden, in.weight.t(), in.targets, 4), c10::Error);
  EXPECT_THROW(LinearCrossEntropy(in.hidden, in.weight.to(at::kBFloat16), in.targets, 4),
               c10::Error);
  EXPECT_THROW(LinearCrossEntropy(in.hidden, in.weight, in.targets.to(at::kInt), 4), c10::Error);
  EXPECT_THROW(LinearCrossEntropy(in.hidden, in.weight, in.targets.narrow(0, 0, 5), 4), c10::Error);
}

// The gradients are handed over by the first backward: a second one says so.
TEST(KernelsCrossEntropyTest, SecondBackwardIsAnError) {
  Case c{6, 8, 19, 4, at::kFloat, 0};
  Inputs in = MakeInputs(c, c10::kCPU);
  at::Tensor h = in.hidden.clone().requires_grad_(true);
  at::Tensor loss = LinearCrossEntropy(h, in.weight, in.targets, 4);
  loss.backward({}, /*retain_graph=*/true);
  EXPECT_THAT([&] { loss.backward(); },
              ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr("second time")));
}

}  // namespace
}  // namespace fsdp::kernels
