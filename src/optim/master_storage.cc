#include "gradkit/optim/master_storage.h"

#include "gradkit/ops/master.h"
#include "optim/moment_storage.h"

namespace gradkit {

MasterStore::MasterStore(MasterStorage how, std::vector<TensorView> weights) : how_(how), weights_(std::move(weights)) {
  if (weights_.empty()) return;
  const Device device = weights_[0].device;
  if (how_ == MasterStorage::remainder) {
    storage_ = allocate_moments(device, weights_, DType::i16, 1);  // zero: each master is its weight
    remainders_ = moment_views(storage_, weights_, DType::i16, 1, 0);
  } else {
    storage_ = allocate_moments(device, weights_, DType::f32, 1);
    masters_ = moment_views(storage_, weights_, DType::f32, 1, 0);
    cast_into(masters_, weights_);
  }
}

std::vector<TensorView> MasterStore::f32(Buffer& scratch, bool join) const {
  if (how_ == MasterStorage::f32 || weights_.empty()) return masters_;
  scratch = allocate_moments(weights_[0].device, weights_, DType::f32, 1);
  std::vector<TensorView> out = moment_views(scratch, weights_, DType::f32, 1, 0);
  for (size_t i = 0; join && i < out.size(); ++i) join_masters(weights_[i], remainders_[i], out[i]);
  return out;
}

void MasterStore::masters_written(const std::vector<TensorView>& f32) {
  if (how_ == MasterStorage::f32) return cast_into(weights_, masters_);
  for (size_t i = 0; i < f32.size(); ++i) split_masters(f32[i], weights_[i], remainders_[i]);
}

}  // namespace gradkit
