#include "train/mlp_cuda.h"

#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "gradkit/core/error.h"

namespace gradkit::train {
namespace {

void check(cudaError_t status, const char* call) {
  if (status != cudaSuccess) throw Error(ErrorCode::cuda_error, std::string(call) + ": " + cudaGetErrorString(status));
}
void check(cublasStatus_t status, const char* call) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw Error(ErrorCode::cuda_error, std::string(call) + " failed with cuBLAS status " + std::to_string(status));
  }
}
#define TRAIN_CHECK(call) check((call), #call)

constexpr int kImage = 784;

__global__ void gather_kernel(const __half* images, const uint8_t* labels, const int32_t* order, int64_t offset,
                              int batch, __half* x, uint8_t* y) {
  const int64_t total = int64_t{batch} * kImage;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t b = i / kImage, p = i % kImage;
    const int64_t index = order[offset + b];
    x[i] = images[index * kImage + p];
    if (p == 0) y[b] = labels[index];
  }
}

// out[b][o] = act(out[b][o] + bias[o]), in f32, rounded once to f16.
__global__ void bias_activation_kernel(__half* out, const __half* bias, int batch, int width, bool relu) {
  const int64_t total = int64_t{batch} * width;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    float v = __half2float(out[i]) + __half2float(bias[i % width]);
    if (relu && v < 0) v = 0;
    out[i] = __float2half_rn(v);
  }
}

// One thread per row: softmax cross-entropy, its gradient scaled by
// *loss_scale * scale / batch, and the row's loss.
__global__ void softmax_xent_kernel(const __half* logits, const uint8_t* labels, int batch, int classes, float scale,
                                    const float* loss_scale, __half* delta, float* row_loss) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= batch) return;
  const __half* z = logits + int64_t{b} * classes;
  float top = -INFINITY;
  for (int c = 0; c < classes; ++c) top = fmaxf(top, __half2float(z[c]));
  float sum = 0;
  for (int c = 0; c < classes; ++c) sum += expf(__half2float(z[c]) - top);
  const float factor = *loss_scale * scale / static_cast<float>(batch);
  for (int c = 0; c < classes; ++c) {
    const float p = expf(__half2float(z[c]) - top) / sum;
    delta[int64_t{b} * classes + c] = __float2half_rn((p - (c == labels[b] ? 1.0f : 0.0f)) * factor);
  }
  row_loss[b] = logf(sum) - (__half2float(z[labels[b]]) - top);
}

// One block sums the row losses in a fixed order into the running sum.
__global__ void add_loss_kernel(const float* row_loss, int batch, double* total) {
  __shared__ double partial[256];
  double s = 0;
  for (int i = threadIdx.x; i < batch; i += blockDim.x) s += row_loss[i];
  partial[threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    double t = 0;
    for (int i = 0; i < static_cast<int>(blockDim.x); ++i) t += partial[i];
    *total += t;
  }
}

// db[o] = sum over the batch of delta[b][o], in f32, one thread per output.
__global__ void bias_grad_kernel(const __half* delta, int batch, int width, __half* db) {
  const int o = blockIdx.x * blockDim.x + threadIdx.x;
  if (o >= width) return;
  float s = 0;
  for (int b = 0; b < batch; ++b) s += __half2float(delta[int64_t{b} * width + o]);
  db[o] = __float2half_rn(s);
}

__global__ void relu_mask_kernel(__half* delta, const __half* activation, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    if (!(__half2float(activation[i]) > 0)) delta[i] = __float2half_rn(0.0f);
  }
}

__global__ void correct_kernel(const __half* logits, const uint8_t* labels, int batch, int classes, int* correct) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= batch) return;
  int best = 0;
  for (int c = 1; c < classes; ++c) {
    if (__half2float(logits[int64_t{b} * classes + c]) > __half2float(logits[int64_t{b} * classes + best])) best = c;
  }
  correct[b] = best == labels[b];
}

unsigned blocks_for(int64_t n) { return static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 4096)); }

// Row-major C (m x n) = op(A) (m x k) * op(B) (k x n), f16 in and out, f32
// accumulation: cuBLAS is column-major, so it computes C^T = op(B)^T op(A)^T.
void gemm(cublasHandle_t h, bool transpose_a, bool transpose_b, int m, int n, int k, const __half* a, int lda,
          const __half* b, int ldb, __half* c, int ldc) {
  const float one = 1.0f, zero = 0.0f;
  TRAIN_CHECK(cublasGemmEx(h, transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N, transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N, n, m,
                           k, &one, b, CUDA_R_16F, ldb, a, CUDA_R_16F, lda, &zero, c, CUDA_R_16F, ldc,
                           CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

const __half* half_data(const TensorView& t) { return static_cast<const __half*>(t.data); }
__half* half_mutable(const TensorView& t) { return static_cast<__half*>(t.data); }

}  // namespace

struct MlpCuda::State {
  cublasHandle_t cublas = nullptr;
  Buffer train_images, train_labels, test_images, test_labels, order;
  int64_t test_count = 0;
  Buffer x, y, row_loss, loss_sum, correct;
  std::vector<Buffer> activations;  // per layer, batch x width
  Buffer delta, delta_below;
  int capacity = 0;
};

MlpCuda::MlpCuda(std::vector<int> widths, Device device)
    : widths_(std::move(widths)), device_(device), state_(std::make_unique<State>()) {
  TRAIN_CHECK(cudaSetDevice(device.index));
  TRAIN_CHECK(cublasCreate(&state_->cublas));
  state_->loss_sum = Buffer(device, sizeof(double));
}

MlpCuda::~MlpCuda() {
  if (state_->cublas != nullptr) cublasDestroy(state_->cublas);
}

void MlpCuda::upload(const Split& train, const Split& test) {
  auto to_device = [&](const Split& s, Buffer& images, Buffer& labels) {
    std::vector<__half> h(s.images.size());
    for (size_t i = 0; i < h.size(); ++i) h[i] = __float2half_rn(s.images[i]);
    images = Buffer(device_, h.size() * sizeof(__half));
    copy_from_host(images.data(), device_, h.data(), h.size() * sizeof(__half));
    labels = Buffer(device_, s.labels.size());
    copy_from_host(labels.data(), device_, s.labels.data(), s.labels.size());
  };
  to_device(train, state_->train_images, state_->train_labels);
  to_device(test, state_->test_images, state_->test_labels);
  state_->test_count = test.count;
}

void MlpCuda::set_order(const std::vector<int64_t>& order) {
  std::vector<int32_t> o(order.begin(), order.end());
  if (state_->order.bytes() != o.size() * sizeof(int32_t)) state_->order = Buffer(device_, o.size() * sizeof(int32_t));
  copy_from_host(state_->order.data(), device_, o.data(), o.size() * sizeof(int32_t));
}

void MlpCuda::reserve(int batch) {
  State& s = *state_;
  if (batch <= s.capacity) return;
  s.capacity = batch;
  s.activations.clear();
  int widest = 0;
  for (int w : widths_) {
    s.activations.emplace_back(device_, sizeof(__half) * batch * w);
    widest = std::max(widest, w);
  }
  s.x = Buffer(device_, sizeof(__half) * batch * kImage);
  s.y = Buffer(device_, batch);
  s.row_loss = Buffer(device_, sizeof(float) * batch);
  s.correct = Buffer(device_, sizeof(int) * batch);
  s.delta = Buffer(device_, sizeof(__half) * batch * widest);
  s.delta_below = Buffer(device_, sizeof(__half) * batch * widest);
}

void MlpCuda::forward(const void* input, int batch, std::span<const TensorView> params) {
  State& s = *state_;
  const __half* in = static_cast<const __half*>(input);
  const size_t layers = widths_.size() - 1;
  for (size_t l = 1; l <= layers; ++l) {
    const int n_in = widths_[l - 1], n_out = widths_[l];
    auto* out = static_cast<__half*>(s.activations[l].data());
    gemm(s.cublas, false, true, batch, n_out, n_in, in, n_in, half_data(params[2 * (l - 1)]), n_in, out, n_out);
    bias_activation_kernel<<<blocks_for(int64_t{batch} * n_out), 256>>>(out, half_data(params[2 * (l - 1) + 1]),
                                                                        batch, n_out, l < layers);
    TRAIN_CHECK(cudaGetLastError());
    in = out;
  }
}

void MlpCuda::forward_backward(int64_t offset, int batch, float scale, const float* loss_scale,
                               std::span<const TensorView> params, std::span<const TensorView> grads) {
  reserve(batch);
  State& s = *state_;
  const size_t layers = widths_.size() - 1;
  const int classes = widths_.back();
  gather_kernel<<<blocks_for(int64_t{batch} * kImage), 256>>>(
      static_cast<const __half*>(s.train_images.data()), static_cast<const uint8_t*>(s.train_labels.data()),
      static_cast<const int32_t*>(s.order.data()), offset, batch, static_cast<__half*>(s.x.data()),
      static_cast<uint8_t*>(s.y.data()));
  TRAIN_CHECK(cudaGetLastError());
  forward(s.x.data(), batch, params);
  auto* delta = static_cast<__half*>(s.delta.data());
  auto* below = static_cast<__half*>(s.delta_below.data());
  softmax_xent_kernel<<<(batch + 127) / 128, 128>>>(static_cast<const __half*>(s.activations[layers].data()),
                                                    static_cast<const uint8_t*>(s.y.data()), batch, classes, scale,
                                                    loss_scale, delta, static_cast<float*>(s.row_loss.data()));
  add_loss_kernel<<<1, 256>>>(static_cast<const float*>(s.row_loss.data()), batch, static_cast<double*>(s.loss_sum.data()));
  TRAIN_CHECK(cudaGetLastError());
  for (size_t l = layers; l >= 1; --l) {
    const int n_in = widths_[l - 1], n_out = widths_[l];
    const __half* in = l == 1 ? static_cast<const __half*>(s.x.data()) : static_cast<const __half*>(s.activations[l - 1].data());
    gemm(s.cublas, true, false, n_out, n_in, batch, delta, n_out, in, n_in, half_mutable(grads[2 * (l - 1)]), n_in);
    bias_grad_kernel<<<(n_out + 127) / 128, 128>>>(delta, batch, n_out, half_mutable(grads[2 * (l - 1) + 1]));
    TRAIN_CHECK(cudaGetLastError());
    if (l == 1) break;
    gemm(s.cublas, false, false, batch, n_in, n_out, delta, n_out, half_data(params[2 * (l - 1)]), n_in, below, n_in);
    relu_mask_kernel<<<blocks_for(int64_t{batch} * n_in), 256>>>(below, static_cast<const __half*>(s.activations[l - 1].data()),
                                                                int64_t{batch} * n_in);
    TRAIN_CHECK(cudaGetLastError());
    std::swap(delta, below);
  }
}

double MlpCuda::take_loss_sum() {
  double sum = 0;
  copy_to_host(&sum, state_->loss_sum.data(), sizeof sum, device_);
  const double zero = 0;
  copy_from_host(state_->loss_sum.data(), device_, &zero, sizeof zero);
  return sum;
}

int64_t MlpCuda::count_correct(int64_t first, int64_t step, std::span<const TensorView> params) {
  State& s = *state_;
  std::vector<int32_t> indices;
  for (int64_t i = first; i < s.test_count; i += step) indices.push_back(static_cast<int32_t>(i));
  Buffer index_buffer(device_, indices.size() * sizeof(int32_t) + 4);
  copy_from_host(index_buffer.data(), device_, indices.data(), indices.size() * sizeof(int32_t));
  int64_t correct = 0;
  constexpr int kChunk = 1000;
  std::vector<int> flags(kChunk);
  for (size_t at = 0; at < indices.size(); at += kChunk) {
    const int n = static_cast<int>(std::min<size_t>(kChunk, indices.size() - at));
    reserve(n);
    gather_kernel<<<blocks_for(int64_t{n} * kImage), 256>>>(
        static_cast<const __half*>(s.test_images.data()), static_cast<const uint8_t*>(s.test_labels.data()),
        static_cast<const int32_t*>(index_buffer.data()), static_cast<int64_t>(at), n, static_cast<__half*>(s.x.data()),
        static_cast<uint8_t*>(s.y.data()));
    forward(s.x.data(), n, params);
    correct_kernel<<<(n + 127) / 128, 128>>>(static_cast<const __half*>(s.activations.back().data()),
                                             static_cast<const uint8_t*>(s.y.data()), n, widths_.back(),
                                             static_cast<int*>(s.correct.data()));
    TRAIN_CHECK(cudaGetLastError());
    copy_to_host(flags.data(), s.correct.data(), sizeof(int) * n, device_);
    for (int i = 0; i < n; ++i) correct += flags[i];
  }
  return correct;
}

}  // namespace gradkit::train
