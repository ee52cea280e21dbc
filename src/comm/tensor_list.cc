#include "comm/tensor_list.h"

#include <algorithm>
#include <string>
#include <vector>

#include "spec/cuda_runtime.h"
#include "gradkit/core/error.h"

namespace gradkit::comm {

namespace {

std::string element_name(std::string_view arg, size_t i) { return std::string(arg) + "[" + std::to_string(i) + "]"; }

struct Span {
  uintptr_t begin;
  uintptr_t end;
  size_t index;
  bool output;
};

std::vector<Span> spans_of(std::span<const TensorView> tensors, bool output) {
  std::vector<Span> spans;
  spans.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].numel == 0) continue;
    const auto begin = reinterpret_cast<uintptr_t>(tensors[i].data);
    spans.push_back({begin, begin + tensors[i].bytes(), i, output});
  }
  return spans;
}

}  // namespace

ListInfo inspect_list(std::string_view op, std::string_view arg, std::span<const TensorView> tensors,
                      Device device) {
  ListInfo info;
  if (!tensors.empty()) info.dtype = tensors[0].dtype;
  info.contiguous = true;
  unsigned char* next = nullptr;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorView& t = tensors[i];
    if (t.device != device) {
      throw_argument_error(ErrorCode::device_mismatch, op, element_name(arg, i),
                           "is on " + to_string(t.device) + ", expected " + to_string(device) +
                               " (the communicator's device)");
    }
    if (is_storage_dtype(t.dtype)) {
      throw_argument_error(ErrorCode::dtype_unsupported, op, element_name(arg, i),
                           "is " + std::string(dtype_name(t.dtype)) + ", expected f32, f16, bf16 or f64");
    }
    if (t.dtype != info.dtype) {
      throw_argument_error(ErrorCode::invalid_argument, op, element_name(arg, i),
                           "is " + std::string(dtype_name(t.dtype)) + ", expected " +
                               std::string(dtype_name(info.dtype)) + " (one dtype per list, that of " +
                               std::string(arg) + "[0])");
    }
    if (t.numel < 0 || t.numel > (int64_t{1} << 60)) {
      throw_argument_error(ErrorCode::invalid_argument, op, element_name(arg, i),
                           "has " + std::to_string(t.numel) + " elements, expected a count from 0 to 2^60");
    }
    if (t.numel == 0) continue;
    if (t.data == nullptr) {
      throw_argument_error(ErrorCode::null_pointer, op, element_name(arg, i),
                           "has null data and " + std::to_string(t.numel) + " elements");
    }
    if (reinterpret_cast<uintptr_t>(t.data) % dtype_size(t.dtype) != 0) {
      throw_argument_error(ErrorCode::invalid_argument, op, element_name(arg, i),
                           "starts at an address that is not a multiple of its element size; expected aligned data");
    }
    spec::check_memory_location(op, arg, i, t);
    auto* begin = static_cast<unsigned char*>(t.data);
    if (info.base == nullptr) info.base = begin;
    else if (begin != next) info.contiguous = false;
    next = begin + t.bytes();
    info.total += t.numel;
  }
  return info;
}

void check_matching(std::string_view op, std::span<const TensorView> inputs, std::span<const TensorView> outputs) {
  if (inputs.size() != outputs.size()) {
    throw_argument_error(ErrorCode::size_mismatch, op, "outputs",
                         "has " + std::to_string(outputs.size()) + " tensors, expected " +
                             std::to_string(inputs.size()) + " (one per input)");
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (outputs[i].numel != inputs[i].numel) {
      throw_argument_error(ErrorCode::size_mismatch, op, element_name("outputs", i),
                           "has " + std::to_string(outputs[i].numel) + " elements, expected " +
                               std::to_string(inputs[i].numel) + " (the size of inputs[" + std::to_string(i) + "])");
    }
    if (outputs[i].dtype != inputs[i].dtype) {
      throw_argument_error(ErrorCode::invalid_argument, op, element_name("outputs", i),
                           "is " + std::string(dtype_name(outputs[i].dtype)) + ", expected " +
                               std::string(dtype_name(inputs[i].dtype)) + " (the dtype of inputs[" +
                               std::to_string(i) + "])");
    }
  }
}

bool same_tensors(std::span<const TensorView> inputs, std::span<const TensorView> outputs) {
  if (inputs.size() != outputs.size()) return false;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].data != outputs[i].data || inputs[i].numel != outputs[i].numel ||
        inputs[i].dtype != outputs[i].dtype) {
      return false;
    }
  }
  return true;
}

void check_no_overlap(std::string_view op, std::span<const TensorView> outputs, std::span<const TensorView> inputs) {
  // One sort and one sweep: any two sorted spans that overlap include a pair
  // of neighbours, or a span overlapping the furthest end seen so far.
  std::vector<Span> spans = spans_of(outputs, true);
  const std::vector<Span> read = spans_of(inputs, false);
  spans.insert(spans.end(), read.begin(), read.end());
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  const Span* reach = nullptr;  // the span reaching furthest so far
  const Span* written_reach = nullptr;  // the output span reaching furthest so far
  for (const Span& s : spans) {
    const Span* other = nullptr;
    if (s.output && reach != nullptr && reach->end > s.begin) other = reach;
    else if (!s.output && written_reach != nullptr && written_reach->end > s.begin) other = written_reach;
    if (other != nullptr) {
      const Span& out = s.output ? s : *other;
      const Span& with = s.output ? *other : s;
      throw_argument_error(ErrorCode::aliasing, op, element_name(inputs.empty() ? "tensors" : "outputs", out.index),
                           "overlaps " + element_name(with.output ? (inputs.empty() ? "tensors" : "outputs") : "inputs",
                                                      with.index) +
                               ", expected written tensors to overlap nothing else");
    }
    if (reach == nullptr || s.end > reach->end) reach = &s;
    if (s.output && (written_reach == nullptr || s.end > written_reach->end)) written_reach = &s;
  }
}

ListPair inspect_lists(std::string_view op, std::span<const TensorView> inputs, std::span<const TensorView> outputs,
                       Device device) {
  const bool in_place = same_tensors(inputs, outputs);
  ListPair lists;
  lists.in = inspect_list(op, in_place ? "tensors" : "inputs", inputs, device);
  lists.out = lists.in;
  if (!in_place) {
    lists.out = inspect_list(op, "outputs", outputs, device);
    check_matching(op, inputs, outputs);
    check_no_overlap(op, outputs, inputs);
  } else {
    check_no_overlap(op, inputs, {});
  }
  return lists;
}

namespace {

bool same_views(std::span<const TensorView> a, const std::vector<TensorView>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].data != b[i].data || a[i].numel != b[i].numel || a[i].dtype != b[i].dtype || a[i].device != b[i].device) {
      return false;
    }
  }
  return true;
}

}  // namespace

ListPair ListCheckCache::inspect(std::string_view op, std::span<const TensorView> inputs,
                                 std::span<const TensorView> outputs, Device device) {
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (same_views(inputs, entries_[i].inputs) && same_views(outputs, entries_[i].outputs)) {
      if (i > 0) std::rotate(entries_.begin(), entries_.begin() + static_cast<std::ptrdiff_t>(i),
                             entries_.begin() + static_cast<std::ptrdiff_t>(i) + 1);
      return entries_.front().result;
    }
  }
  const ListPair result = inspect_lists(op, inputs, outputs, device);  // throws on a bad list: nothing cached
  if (entries_.size() == kEntries) entries_.pop_back();
  entries_.insert(entries_.begin(), Entry{{inputs.begin(), inputs.end()}, {outputs.begin(), outputs.end()}, result});
  return result;
}

}  // namespace gradkit::comm
