#include "engine/term_watch.h"

#include <ATen/ATen.h>

namespace fsdp {

bool TermWatch::Poll(bool term_here) {
  if (world_.size() == 1) return term_here;
  bool any = false;
  if (work_) {
    work_->wait();
    any = flag_.item<float>() > 0;
  }
  flag_ = at::full({1}, term_here ? 1.0f : 0.0f, at::TensorOptions().dtype(at::kFloat));
  work_ = world_.AllReduce(flag_);
  return any;
}

void TermWatch::Drain() {
  if (!work_) return;
  work_->wait();
  work_.reset();
}

}  // namespace fsdp
