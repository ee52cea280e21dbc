// Where the f32 master weights of an f16/bf16 model live, and the masters
// kept that way (MixedPrecision and Sharded hold theirs in a MasterStore).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "gradkit/core/error.h"
#include "gradkit/core/memory.h"
#include "gradkit/core/tensor.h"

namespace gradkit {

enum class MasterStorage : int32_t {
  f32 = 0,        // a separate f32 master per weight (4 bytes per parameter)
  remainder = 1,  // the bf16 weight and an i16 remainder (2 bytes): docs/ops.md, "the remainder master"
};

// Throws unless `how` is one of the above and, for remainders, every param
// of the groups is bf16, naming the argument (options.master,
// groups[g].params[i]).
template <class Group>
void check_master_storage(std::string_view op, MasterStorage how, const std::vector<Group>& groups) {
  if (how != MasterStorage::f32 && how != MasterStorage::remainder) {
    throw_argument_error(ErrorCode::invalid_argument, op, "options.master",
                         "is " + std::to_string(static_cast<int32_t>(how)) + ", expected f32 or remainder");
  }
  for (size_t g = 0; how == MasterStorage::remainder && g < groups.size(); ++g) {
    for (size_t i = 0; i < groups[g].params.size(); ++i) {
      const DType d = groups[g].params[i].dtype;
      if (d == DType::bf16) continue;
      throw_argument_error(ErrorCode::dtype_unsupported, op,
                           "groups[" + std::to_string(g) + "].params[" + std::to_string(i) + "]",
                           "has dtype " + std::string(dtype_name(d)) +
                               ", expected bf16 (options.master is remainder: a remainder completes bf16 weights)");
    }
  }
}

// The f32 masters of a list of f16/bf16 weights, kept as MasterStorage
// says: an f32 tensor per weight (cast from it), or an i16 remainder per
// bf16 weight (zero: the master starts as the weight). The owner goes
// through it to give the optimizer its tensors and to move the masters to
// and from a state file, which holds f32 masters either way.
class MasterStore {
 public:
  MasterStore() = default;
  // After check_master_storage: allocates the masters (f32: cast from the
  // weights, waited for; remainders: zero).
  MasterStore(MasterStorage how, std::vector<TensorView> weights);

  MasterStorage how() const { return how_; }
  const std::vector<TensorView>& masters() const { return masters_; }        // f32 form; else empty
  const std::vector<TensorView>& remainders() const { return remainders_; }  // remainder form; else empty
  size_t bytes() const { return storage_.bytes(); }

  // What the optimizer updates for weights [first, first + count), appended
  // to an optimizer group: f32 masters to its params and the weights to its
  // model_copy (the update writes them as the masters' copy), or the weights
  // to its params and their remainders to its weight_remainder.
  template <class Group>
  void append_to(Group& group, size_t first, size_t count) const {
    const auto at = [&](const std::vector<TensorView>& list, size_t k) { return list.begin() + first + k; };
    if (how_ == MasterStorage::remainder) {
      group.params.insert(group.params.end(), at(weights_, 0), at(weights_, count));
      group.weight_remainder.insert(group.weight_remainder.end(), at(remainders_, 0), at(remainders_, count));
      return;
    }
    group.params.insert(group.params.end(), at(masters_, 0), at(masters_, count));
    group.model_copy.insert(group.model_copy.end(), at(weights_, 0), at(weights_, count));
  }

  // The masters as f32 tensors: masters(), or, for remainders, f32 tensors
  // in `scratch` (joined from weight and remainder when `join`; left for a
  // load to fill otherwise).
  std::vector<TensorView> f32(Buffer& scratch, bool join) const;
  // The masters' shapes as a state file holds them (f32), for checking a
  // file's section before anything is read into them: no data.
  std::vector<TensorView> file_shapes() const {
    std::vector<TensorView> out = weights_;
    for (TensorView& t : out) t.dtype = DType::f32;
    return out;
  }
  // After f32 masters were written into f32(scratch, false)'s tensors: the
  // weights from them (cast), and the remainders (split).
  void masters_written(const std::vector<TensorView>& f32);

 private:
  MasterStorage how_ = MasterStorage::f32;
  std::vector<TensorView> weights_, masters_, remainders_;
  Buffer storage_;
};

}  // namespace gradkit
