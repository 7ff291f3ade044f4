#include "engine/term_watch.h"

#include <ATen/ATen.h>

namespace fsdp {

TermWatch::TermWatch(ProcessGroup& world)
    : world_(world), flag_(at::zeros({1}, at::TensorOptions().dtype(at::kFloat))) {}

bool TermWatch::Poll(bool term_here) {
  if (world_.size() == 1) return term_here;
  bool any = false;
  if (work_) {
    work_->wait();  // the all-reduce is done with flag_: it is reused for the next one
    any = flag_.item<float>() > 0;
  }
  flag_.fill_(term_here ? 1.0f : 0.0f);
  work_ = world_.AllReduce(flag_);
  return any;
}

void TermWatch::Drain() {
  if (!work_) return;
  work_->wait();
  work_.reset();
}

}  // namespace fsdp
