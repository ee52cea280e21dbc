// Muon on CUDA: the element kernels of cuda/muon_elements.cuh over the
// batch's chunk table (the momentum pass with each chunk's sum of squares,
// the normalisation, the weight update) and, between them, ns_steps x 3
// strided-batched bf16 products through cuBLASLt (f32 accumulation; the
// library loaded when the first plan with products is made,
// cuda/cublaslt_library.h), one call per stage for all the batch's
// matrices; the streams and the recorded CUDA graph that run them.
#include <cublasLt.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "spec/muon.h"
#include "cuda/cublaslt_library.h"
#include "cuda/muon_elements.cuh"
#include "cuda/multi_tensor.cuh"

namespace gradkit::spec {
namespace {

using bf16 = __nv_bfloat16;
using cuda::cublaslt;
using muon_cuda::AssembleOp;
using muon_cuda::DisperseOp;
using muon_cuda::EquilibrateOp;
using muon_cuda::MomentumOp;
using muon_cuda::NormaliseOp;
using muon_cuda::WeightOp;

[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* call, const char* file, int line) {
  throw Error(ErrorCode::cuda_error, std::string(call) + " failed: cuBLAS status " + std::to_string(status) + " at " +
                                         file + ":" + std::to_string(line));
}

#define GRADKIT_CUBLAS_CHECK(call)                                                          \
  do {                                                                                      \
    const cublasStatus_t gradkit_status_ = (call);                                          \
    if (gradkit_status_ != CUBLAS_STATUS_SUCCESS)                                           \
      throw_cublas_error(gradkit_status_, #call, __FILE__, __LINE__);                       \
  } while (0)

// ---- The products ---------------------------------------------------------

// One product's shape: D = alpha op(A) op(B) + beta C over `batch` matrices,
// column major (cuBLAS's view of our row-major matrices as their transposes).
struct GemmShape {
  bool trans_a, trans_b;
  int64_t m, n, k, lda, ldb, ldc, stride_a, stride_b, stride_c, batch;
};

// Each operand's alignment in bytes (at most 256), which the heuristic must
// know: that of its pointer, its leading dimension and its batch stride.
struct GemmAlignment {
  uint32_t a, b, c;
};

uint32_t operand_alignment(const void* pointer, int64_t ld, int64_t stride) {
  const auto bytes =
      static_cast<uint64_t>(reinterpret_cast<uintptr_t>(pointer)) | static_cast<uint64_t>(ld * 2) |
      static_cast<uint64_t>(stride * 2) | 256u;
  return static_cast<uint32_t>(bytes & (~bytes + 1));
}

auto gemm_key(const GemmShape& s, const GemmAlignment& al, size_t workspace) {
  return std::make_tuple(s.trans_a, s.trans_b, s.m, s.n, s.k, s.lda, s.ldb, s.ldc, s.stride_a, s.stride_b, s.stride_c,
                         s.batch, al.a, al.b, al.c, workspace);
}

// Where a batch's products run: a stream and the cuBLASLt workspace that
// stream alone uses (products on two streams at once need two).
struct GemmStream {
  cudaStream_t stream;
  void* workspace;
  size_t workspace_bytes;
  bool dry = false;  // choose each product's algorithm, launch nothing (a plan's construction)
};

// Descriptors and the heuristic's algorithm for one GemmShape, made once.
struct PreparedGemm {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~PreparedGemm() {
    if (a) cublaslt().cublasLtMatrixLayoutDestroy(a);
    if (b) cublaslt().cublasLtMatrixLayoutDestroy(b);
    if (c) cublaslt().cublasLtMatrixLayoutDestroy(c);
    if (desc) cublaslt().cublasLtMatmulDescDestroy(desc);
  }
};

cublasLtMatrixLayout_t make_layout(int64_t rows, int64_t cols, int64_t ld, int64_t stride, int64_t batch) {
  const cuda::CublasLtLibrary& lt = cublaslt();
  cublasLtMatrixLayout_t layout;
  GRADKIT_CUBLAS_CHECK(lt.cublasLtMatrixLayoutCreate(&layout, CUDA_R_16BF, rows, cols, ld));
  const auto count = static_cast<int32_t>(batch);
  GRADKIT_CUBLAS_CHECK(
      lt.cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
  GRADKIT_CUBLAS_CHECK(
      lt.cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                          sizeof(stride)));
  return layout;
}

// 32 MiB: what cuBLAS asks for on Hopper for its largest tiles; a side
// stream's products are small (MuonPlanOptions::streams), 4 MiB each.
constexpr size_t kGemmWorkspace = size_t{32} << 20;
constexpr size_t kLaneWorkspace = size_t{4} << 20;

struct GemmState {
  // A side stream that small batches run on beside the others.
  struct Lane {
    cudaStream_t stream = nullptr;
    cudaEvent_t done = nullptr;
    void* workspace = nullptr;
  };

  // What a recorded step depends on beyond the plan's memory and tables:
  // the per-step inputs' values and each batch's product coefficients.
  using GraphKey = std::vector<double>;

  // What muon_cuda_beside runs a slot on: one of the side streams, an
  // event that starts it after the caller's work so far, and one that the
  // caller joins.
  struct Beside {
    cudaEvent_t fork = nullptr, done = nullptr;
  };

  int device = 0;
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::vector<Lane> lanes;
  std::vector<cudaStream_t> sides;
  std::vector<Beside> beside;  // per slot
  cudaEvent_t fork = nullptr;
  // A recorded step, one per slot (muon_cuda_step).
  struct Recording {
    cudaGraphExec_t graph = nullptr;  // the recorded step, for `key`
    GraphKey key;
    bool stepped = false;  // it has run eagerly once (lazy initialisations are done)
  };
  cudaStream_t capture = nullptr;   // the stream a step is recorded on
  std::vector<Recording> recordings;
  bool graphs_off = false;   // recording failed once: eager from then on
  std::mutex mutex;
  std::map<decltype(gemm_key(GemmShape{}, GemmAlignment{}, 0)), std::unique_ptr<PreparedGemm>> prepared;

  ~GemmState() {
    cuda::DeviceGuard guard(device);
    for (const Recording& r : recordings) {
      if (r.graph) cudaGraphExecDestroy(r.graph);
    }
    if (capture) cudaStreamDestroy(capture);
    prepared.clear();
    for (const Beside& b : beside) {
      if (b.done) cudaEventDestroy(b.done);
      if (b.fork) cudaEventDestroy(b.fork);
    }
    for (cudaStream_t side : sides) {
      if (side) cudaStreamDestroy(side);
    }
    for (Lane& lane : lanes) {
      if (lane.workspace) cudaFree(lane.workspace);
      if (lane.done) cudaEventDestroy(lane.done);
      if (lane.stream) cudaStreamDestroy(lane.stream);
    }
    if (fork) cudaEventDestroy(fork);
    if (workspace) cudaFree(workspace);
    if (handle) cublaslt().cublasLtDestroy(handle);
  }

  const PreparedGemm& prepare(const GemmShape& s, const GemmAlignment& al, size_t workspace_bytes) {
    std::lock_guard lock(mutex);
    auto& slot = prepared[gemm_key(s, al, workspace_bytes)];
    if (slot) return *slot;
    const cuda::CublasLtLibrary& lt = cublaslt();
    auto p = std::make_unique<PreparedGemm>();
    GRADKIT_CUBLAS_CHECK(lt.cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, tb = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    GRADKIT_CUBLAS_CHECK(lt.cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    GRADKIT_CUBLAS_CHECK(lt.cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    // Stored shapes: op(A) is m x k, op(B) is k x n.
    p->a = s.trans_a ? make_layout(s.k, s.m, s.lda, s.stride_a, s.batch) : make_layout(s.m, s.k, s.lda, s.stride_a, s.batch);
    p->b = s.trans_b ? make_layout(s.n, s.k, s.ldb, s.stride_b, s.batch) : make_layout(s.k, s.n, s.ldb, s.stride_b, s.batch);
    p->c = make_layout(s.m, s.n, s.ldc, s.stride_c, s.batch);
    cublasLtMatmulPreference_t preference;
    GRADKIT_CUBLAS_CHECK(lt.cublasLtMatmulPreferenceCreate(&preference));
    const size_t bytes = workspace_bytes;
    GRADKIT_CUBLAS_CHECK(lt.cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                                 &bytes, sizeof(bytes)));
    // A split-K algorithm adds its parts in f32 or not at all: the INPLACE and
    // OUTPUT_TYPE schemes add them in bf16, the output's type, which a lone
    // small matrix's product would otherwise get from the heuristic (the
    // products are bf16 products with f32 accumulation, as torch's).
    const uint32_t reductions = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    GRADKIT_CUBLAS_CHECK(lt.cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                                 &reductions, sizeof(reductions)));
    for (const auto& [attribute, value] : {std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, al.a},
                                           std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, al.b},
                                           std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, al.c},
                                           std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, al.c}}) {
      GRADKIT_CUBLAS_CHECK(lt.cublasLtMatmulPreferenceSetAttribute(preference, attribute, &value, sizeof(value)));
    }
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t status =
        lt.cublasLtMatmulAlgoGetHeuristic(handle, p->desc, p->a, p->b, p->c, p->c, preference, 1, &result, &found);
    lt.cublasLtMatmulPreferenceDestroy(preference);
    GRADKIT_CUBLAS_CHECK(status);
    if (found == 0) {
      throw Error(ErrorCode::cuda_error, "muon_step: cuBLASLt has no algorithm for a " + std::to_string(s.m) + " x " +
                                             std::to_string(s.n) + " x " + std::to_string(s.k) + " bf16 product");
    }
    p->algo = result.algo;
    slot = std::move(p);
    return *slot;
  }

  void run(const GemmShape& s, float alpha, const bf16* a, const bf16* b, float beta, const bf16* c, bf16* d,
           const GemmStream& on) {
    // C and D share a layout: their alignment is the lesser of the two.
    const GemmAlignment al{operand_alignment(a, s.lda, s.stride_a), operand_alignment(b, s.ldb, s.stride_b),
                           std::min(operand_alignment(c, s.ldc, s.stride_c), operand_alignment(d, s.ldc, s.stride_c))};
    const PreparedGemm& p = prepare(s, al, on.workspace_bytes);
    if (on.dry) return;
    GRADKIT_CUBLAS_CHECK(cublaslt().cublasLtMatmul(handle, p.desc, &alpha, a, p.a, b, p.b, &beta, c, p.c, d, p.c,
                                                   &p.algo, on.workspace, on.workspace_bytes, on.stream));
  }
};

// Workspace layout (bf16): X of every matrix, X' of every matrix, then the
// Gram products A and B = b A + c A A, then (f32) the chunks' partial sums
// twice (MuonEq's scaled matrix has its own), and the result's scales:
// max(rows, cols) line factors a matrix, and a Muon+ factor a matrix.
struct CudaWorkspace {
  bf16* x;
  bf16* x_next;
  bf16* gram;
  bf16* poly;
  float* partials;
  float* scaled_partials;
  float* lines;
  float* factors;

  // Each buffer starts 256-byte aligned (the products' fastest tiles want 16).
  static size_t aligned(size_t bytes) { return (bytes + 255) / 256 * 256; }
  static size_t matrices_bytes(int64_t count, int64_t rows, int64_t cols) {
    return aligned(sizeof(bf16) * count * rows * cols);
  }
  static size_t matrices_bytes(const MuonPlan::Batch& b) { return matrices_bytes(b.count, b.rows, b.cols); }
  static size_t gram_bytes(int64_t count, int64_t rows, int64_t cols) {
    const int64_t m = std::min(rows, cols);
    return aligned(sizeof(bf16) * count * m * m);
  }
  static size_t gram_bytes(const MuonPlan::Batch& b) { return gram_bytes(b.count, b.rows, b.cols); }
  static size_t scales_floats(int64_t count, int64_t rows, int64_t cols) {
    return static_cast<size_t>(count * (std::max(rows, cols) + 1));
  }
  static size_t bytes(int64_t count, int64_t rows, int64_t cols, size_t chunks) {
    return 2 * matrices_bytes(count, rows, cols) + 2 * gram_bytes(count, rows, cols) +
           sizeof(float) * (2 * chunks + scales_floats(count, rows, cols));
  }

  CudaWorkspace(const MuonPlan::Batch& b, void* base) {
    auto* at = static_cast<unsigned char*>(base);
    x = reinterpret_cast<bf16*>(at);  // first: an orthogonalize batch's plan lists these matrices
    x_next = reinterpret_cast<bf16*>(at + matrices_bytes(b));
    gram = reinterpret_cast<bf16*>(at + 2 * matrices_bytes(b));
    poly = reinterpret_cast<bf16*>(at + 2 * matrices_bytes(b) + gram_bytes(b));
    partials = reinterpret_cast<float*>(at + 2 * matrices_bytes(b) + 2 * gram_bytes(b));
    scaled_partials = partials + b.plan.chunks().size();
    lines = scaled_partials + b.plan.chunks().size();
    factors = lines + b.count * std::max(b.rows, b.cols);
  }
};

// S[i + j m] = S[j + i m] for i < m1 <= j, in every matrix of the batch: the
// upper right block of a symmetric S from its lower left one (32 x 32 tiles
// through shared memory, so that both sides are read and written in rows).
__global__ void mirror_kernel(bf16* s, int64_t m, int64_t m1, int64_t stride) {
  __shared__ bf16 tile[32][33];
  bf16* matrix = s + blockIdx.z * stride;
  const int64_t j0 = m1 + blockIdx.x * 32, i0 = blockIdx.y * 32;  // the upper block's tile: rows i0.., columns j0..
  // Read the lower block's tile (rows j0.., columns i0..), coalesced along its rows (col-major: j fastest).
  for (int r = threadIdx.y; r < 32; r += blockDim.y) {
    const int64_t j = j0 + threadIdx.x, i = i0 + r;
    if (j < m && i < m1) tile[r][threadIdx.x] = matrix[j + i * m];
  }
  __syncthreads();
  for (int r = threadIdx.y; r < 32; r += blockDim.y) {
    const int64_t i = i0 + threadIdx.x, j = j0 + r;
    if (i < m1 && j < m) matrix[i + j * m] = tile[threadIdx.x][r];
  }
}

void mirror_upper(bf16* s, int64_t m, int64_t m1, int64_t stride, int64_t batch, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((m - m1 + 31) / 32), static_cast<unsigned>((m1 + 31) / 32),
                  static_cast<unsigned>(batch));
  mirror_kernel<<<grid, dim3(32, 8), 0, stream>>>(s, m, m1, stride);
  GRADKIT_CUDA_CHECK_LAUNCH();
}

// The rows of Y (m x k) as cuBLAS sees them: Y's rows are the columns of a
// column-major M (ld) when `transposed` (Y = Mt), else M's rows (Y = M).
struct RowOperand {
  const bf16* base;
  bool transposed;
  int64_t k, ld, stride;
  const bf16* rows(int64_t first) const { return base + first * (transposed ? ld : 1); }
};

// D = alpha Y Yt + beta C over the batch (m x m, column major, ld m, stride
// sd), C being D's shape (beta 0: none). Whole (one product), or, with
// m1 > 0, by row blocks Y1 (m1 rows) and Y2: the blocks D11, D21, D22 as
// three products and D12 mirrored from D21, 3/4 of the multiplications; D is
// then symmetric bit for bit.
void symmetric_product(GemmState& gemm, const RowOperand& y, int64_t m, int64_t m1, float alpha, float beta,
                       const bf16* c, bf16* d, int64_t sd, int64_t batch, const GemmStream& stream) {
  const bool t = y.transposed;
  const auto product = [&](int64_t r0, int64_t rows, int64_t c0, int64_t cols) {
    const GemmShape shape{t, !t, rows, cols, y.k, y.ld, y.ld, m, y.stride, y.stride, sd, batch};
    const int64_t at = r0 + c0 * m;
    gemm.run(shape, alpha, y.rows(r0), y.rows(c0), beta, beta != 0.0f ? c + at : d + at, d + at, stream);
  };
  if (m1 <= 0) return product(0, m, 0, m);
  product(0, m1, 0, m1);
  product(m1, m - m1, 0, m1);
  product(m1, m - m1, m1, m - m1);
  if (!stream.dry) mirror_upper(d, m, m1, sd, batch, stream.stream);
}

// The first row block's size when split: about half, a multiple of 64 (the
// products' tiles), or 0 below `split_from`.
int64_t split_rows(int64_t m, int64_t split_from) { return m >= split_from && m >= 128 ? m / 2 / 64 * 64 : 0; }

// ns_steps iterations of torch's algorithm on each matrix X (rows <= cols)
// or on its transpose (rows > cols), written on the row-major X itself,
// which cuBLAS sees as the column-major M = Xt (cols x rows):
//   wide: A = Mt M, B = c A A + b A, M' = a M + M Bt   (X' = a X + B X)
//   tall: A = M Mt, B = c A A + b A, M' = a M + B M    (Y' = a Y + B Y, Y = Xt)
// Returns the buffer that holds the result.
bf16* newton_schulz(GemmState& gemm, const MuonPlan::Batch& b, const CudaWorkspace& w, const MuonHyperparameters& h,
                    int64_t split_from, const GemmStream& stream) {
  const bool wide = b.rows <= b.cols;
  const int64_t R = b.rows, C = b.cols, m = wide ? R : C, n = b.count;
  const int64_t sx = R * C, sg = m * m, m1 = split_rows(m, split_from);
  // A = X Xt: X's rows are M's columns (wide) or M's rows (tall, Y = M).
  // B = c A A + b A; split, as c A At + b A: A is then symmetric bit for bit.
  const GemmShape poly{false, false, m, m, m, m, m, m, sg, sg, sg, n};
  const GemmShape update = wide ? GemmShape{false, true, C, R, R, C, m, C, sx, sg, sx, n}
                                : GemmShape{false, false, C, R, C, m, C, C, sg, sx, sx, n};
  bf16* in = w.x;
  bf16* out = w.x_next;
  for (int32_t s = 0; s < h.ns_steps; ++s) {
    const MuonNsCoefficients& k = h.ns_iteration(s);
    symmetric_product(gemm, RowOperand{in, wide, wide ? C : R, C, sx}, m, m1, 1.0f, 0.0f, nullptr, w.gram, sg, n,
                      stream);
    if (m1 > 0) {
      symmetric_product(gemm, RowOperand{w.gram, false, m, m, sg}, m, m1, k.c, k.b, w.gram, w.poly, sg, n, stream);
    } else {  // torch's A A as it is written
      gemm.run(poly, k.c, w.gram, w.gram, k.b, w.gram, w.poly, stream);
    }
    if (wide) gemm.run(update, 1.0f, in, w.poly, k.a, in, out, stream);
    else gemm.run(update, 1.0f, w.poly, in, k.a, in, out, stream);
    std::swap(in, out);
  }
  return in;
}

// MuonEq (where the group has it), the normalisation and Newton-Schulz on
// the workspace's matrices (their chunks' sums made); returns the buffer
// that holds the result.
const bf16* orthogonalise(const MuonLaunch& l, const CudaWorkspace& w, cudaStream_t stream) {
  const MuonPlan::Batch& b = *l.batch;
  const int64_t elements = b.rows * b.cols;
  const float* sums = w.partials;
  if (l.hyper->equilibrate_rows) {
    cuda::launch_multi_tensor(
        b.plan, EquilibrateOp{w.x, w.partials, w.scaled_partials, b.rows, b.cols, elements, l.found_inf},
        Stream{stream});
    sums = w.scaled_partials;
  }
  cuda::launch_multi_tensor(b.plan, NormaliseOp{l.table, w.x, sums, elements, l.found_inf}, Stream{stream});
  auto& gemm = *static_cast<GemmState*>(const_cast<void*>(l.gemm));
  const GemmStream on = l.lane >= 0 ? GemmStream{stream, gemm.lanes[static_cast<size_t>(l.lane)].workspace, kLaneWorkspace}
                                    : GemmStream{stream, gemm.workspace, kGemmWorkspace};
  return newton_schulz(gemm, b, w, *l.hyper, l.split_from, on);
}

// Muon+ and NorMuon: the result's line sums, then its scales (one block a
// matrix), for the weight pass. One more read of the result: the scales
// need each whole matrix's sums before any weight can take them.
void scale_result(const MuonLaunch& l, const CudaWorkspace& w, const bf16* result, cudaStream_t stream) {
  const MuonPlan::Batch& b = *l.batch;
  constexpr unsigned kThreads = 256;
  const bool per_row = muon_per_row(b.rows, b.cols);
  const int64_t blocks = per_row ? (b.rows + kThreads / 32 - 1) / (kThreads / 32) : (b.cols + kThreads - 1) / kThreads;
  muon_cuda::line_sums_kernel<<<dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(b.count)), kThreads, 0,
                                stream>>>(result, w.lines, b.rows, b.cols, l.found_inf);
  GRADKIT_CUDA_CHECK_LAUNCH();
  muon_cuda::result_scales_kernel<<<static_cast<unsigned>(b.count), 1024, 0, stream>>>(
      l.table, w.lines, w.factors, l.hyper->second_moment ? b.second_moment : nullptr, b.rows, b.cols, l.found_inf);
  GRADKIT_CUDA_CHECK_LAUNCH();
}

// A sharded plan's owned batch: assembled, orthogonalised, dispersed.
void run_orthogonalize(const MuonLaunch& l, cudaStream_t stream) {
  const MuonPlan::Batch& b = *l.batch;
  const CudaWorkspace w(b, l.workspace);
  const int64_t elements = b.rows * b.cols;
  auto* exchange = static_cast<bf16*>(l.exchange);
  cuda::launch_multi_tensor(b.plan, AssembleOp{l.pieces, l.ranks, l.pieces_by_rows, exchange, w.x, w.partials, elements, b.cols,
                                                       l.found_inf},
                            Stream{stream});
  const bf16* result = orthogonalise(l, w, stream);
  cuda::launch_multi_tensor(b.plan, DisperseOp{l.pieces, l.ranks, l.pieces_by_rows, exchange, result, elements, b.cols, l.found_inf},
                            Stream{stream});
}

template <class P, class G, class M>
void run(const MuonLaunch& l, cudaStream_t stream) {
  const MuonPlan::Batch& b = *l.batch;
  const int64_t elements = b.rows * b.cols;
  const Stream s{stream};
  if (l.stage == MuonStage::momentum) {
    return cuda::launch_multi_tensor(b.plan, MomentumOp<P, G, M>{l.table, b.rows, b.cols, nullptr, nullptr, elements,
                                                                 l.found_inf, l.grad_scale, l.grad_scale_device}, s);
  }
  if (l.stage == MuonStage::update) {
    return cuda::launch_multi_tensor(b.plan, WeightOp<P>{l.table, b.rows, b.cols, nullptr, elements, l.found_inf}, s);
  }
  const CudaWorkspace w(b, l.workspace);
  cuda::launch_multi_tensor(b.plan, MomentumOp<P, G, M>{l.table, b.rows, b.cols, w.x, w.partials, elements, l.found_inf,
                                                        l.grad_scale, l.grad_scale_device}, s);
  const bf16* result = orthogonalise(l, w, stream);
  WeightOp<P> weight{l.table, b.rows, b.cols, result, elements, l.found_inf};
  if (l.hyper->renormalize || l.hyper->second_moment) {
    scale_result(l, w, result, stream);
    weight.lines = w.lines;
    weight.factors = w.factors;
  }
  cuda::launch_multi_tensor(b.plan, weight, s);
}

template <class P, class G>
void dispatch_momentum(const MuonLaunch& l, cudaStream_t stream) {
  if (l.batch->plan.dtype(2) == DType::f32) run<P, G, float>(l, stream);
  else run<P, G, bfloat16>(l, stream);
}

template <class P>
void dispatch_grad(const MuonLaunch& l, cudaStream_t stream) {
  switch (l.batch->plan.dtype(1)) {
    case DType::f32: return dispatch_momentum<P, float>(l, stream);
    case DType::f16: return dispatch_momentum<P, half>(l, stream);
    default: return dispatch_momentum<P, bfloat16>(l, stream);
  }
}

}  // namespace

size_t muon_cuda_workspace_bytes(const MuonPlan::Batch& b) {
  return CudaWorkspace::bytes(b.count, b.rows, b.cols, b.plan.chunks().size());
}

size_t muon_cuda_workspace_bytes(int64_t count, int64_t rows, int64_t cols, size_t chunks) {
  return CudaWorkspace::bytes(count, rows, cols, chunks);
}

std::shared_ptr<void> muon_cuda_gemm(Device device, int lanes, bool products, int sides, int slots) {
  // The products' library, loaded before anything is made: a process
  // without cuBLASLt is refused when it makes the plan.
  const cuda::CublasLtLibrary* lt =
      products ? &cuda::cublaslt_library("Muon on " + to_string(device) + " (its Newton-Schulz products)") : nullptr;
  cuda::DeviceGuard guard(device.index);
  auto state = std::make_shared<GemmState>();
  state->device = device.index;
  for (int i = 0; i < sides; ++i) {
    GRADKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&state->sides.emplace_back(), cudaStreamNonBlocking));
  }
  for (int i = 0; i < (sides > 0 ? slots : 0); ++i) {
    GemmState::Beside& b = state->beside.emplace_back();
    GRADKIT_CUDA_CHECK(cudaEventCreateWithFlags(&b.fork, cudaEventDisableTiming));
    GRADKIT_CUDA_CHECK(cudaEventCreateWithFlags(&b.done, cudaEventDisableTiming));
  }
  if (!products) return state;  // element passes only: what recording them needs
  GRADKIT_CUBLAS_CHECK(lt->cublasLtCreate(&state->handle));
  GRADKIT_CUDA_CHECK(cudaMalloc(&state->workspace, kGemmWorkspace));
  if (lanes > 0) GRADKIT_CUDA_CHECK(cudaEventCreateWithFlags(&state->fork, cudaEventDisableTiming));
  for (int i = 0; i < lanes; ++i) {
    GemmState::Lane& lane = state->lanes.emplace_back();
    GRADKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&lane.stream, cudaStreamNonBlocking));
    GRADKIT_CUDA_CHECK(cudaEventCreateWithFlags(&lane.done, cudaEventDisableTiming));
    GRADKIT_CUDA_CHECK(cudaMalloc(&lane.workspace, kLaneWorkspace));
  }
  return state;
}

namespace {

// The side streams start after what `stream` holds so far (its recorded
// event), and `stream` goes on once they are done: the step stays ordered
// on the caller's stream, and a CUDA graph recorded on it takes them in.
void fork(const GemmState& state, cudaStream_t stream) {
  GRADKIT_CUDA_CHECK(cudaEventRecord(state.fork, stream));
  for (const GemmState::Lane& lane : state.lanes) GRADKIT_CUDA_CHECK(cudaStreamWaitEvent(lane.stream, state.fork, 0));
}

void join(const GemmState& state, cudaStream_t stream) {
  for (const GemmState::Lane& lane : state.lanes) {
    GRADKIT_CUDA_CHECK(cudaEventRecord(lane.done, lane.stream));
    GRADKIT_CUDA_CHECK(cudaStreamWaitEvent(stream, lane.done, 0));
  }
}

void enqueue(const GemmState& state, std::span<const MuonLaunch> launches, bool concurrent, cudaStream_t stream) {
  if (concurrent) fork(state, stream);
  for (const MuonLaunch& l : launches) {
    const cudaStream_t s = l.lane >= 0 ? state.lanes[static_cast<size_t>(l.lane)].stream : stream;
    if (l.stage == MuonStage::orthogonalize) run_orthogonalize(l, s);
    else if (l.batch->plan.dtype(0) == DType::f32) dispatch_grad<float>(l, s);
    else dispatch_grad<bfloat16>(l, s);
  }
  if (concurrent) join(state, stream);
}

GemmState::GraphKey graph_key(std::span<const MuonLaunch> launches) {
  GemmState::GraphKey key;
  if (launches.empty()) return key;
  const MuonLaunch& first = launches.front();
  key = {static_cast<double>(reinterpret_cast<uintptr_t>(first.found_inf)), first.grad_scale,
         static_cast<double>(reinterpret_cast<uintptr_t>(first.grad_scale_device))};
  // What the host reads when it enqueues: the products' coefficients, the
  // iteration count and which of the recipe's passes run.
  for (const MuonLaunch& l : launches) {
    const MuonHyperparameters& h = *l.hyper;
    for (const MuonNsCoefficients& k : h.ns_coefficient_list()) key.insert(key.end(), {k.a, k.b, k.c});
    key.insert(key.end(), {static_cast<double>(h.ns_coefficient_count), static_cast<double>(h.ns_steps),
                           static_cast<double>(h.equilibrate_rows), static_cast<double>(h.renormalize),
                           static_cast<double>(h.second_moment)});
  }
  return key;
}

// Records the step on the plan's own stream; null if recording failed (the
// step then runs eagerly from here on).
cudaGraphExec_t record(GemmState& state, std::span<const MuonLaunch> launches, bool concurrent) {
  if (state.capture == nullptr) GRADKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&state.capture, cudaStreamNonBlocking));
  GRADKIT_CUDA_CHECK(cudaStreamBeginCapture(state.capture, cudaStreamCaptureModeThreadLocal));
  cudaGraph_t graph = nullptr;
  try {
    enqueue(state, launches, concurrent, state.capture);
  } catch (...) {  // whatever failed, the recording must end, or every later one would fail
    cudaStreamEndCapture(state.capture, &graph);
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();  // the failed recording's error is not the caller's
    return nullptr;
  }
  GRADKIT_CUDA_CHECK(cudaStreamEndCapture(state.capture, &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t status = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  if (status != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return exec;
}

}  // namespace

void muon_cuda_prepare(const void* gemm, std::span<const MuonLaunch> launches) {
  auto& state = *static_cast<GemmState*>(const_cast<void*>(gemm));
  cuda::DeviceGuard guard(state.device);
  for (const MuonLaunch& l : launches) {
    if (l.stage == MuonStage::momentum || l.stage == MuonStage::update) continue;  // no products
    const CudaWorkspace w(*l.batch, l.workspace);
    const GemmStream on = l.lane >= 0 ? GemmStream{nullptr, state.lanes[static_cast<size_t>(l.lane)].workspace,
                                                   kLaneWorkspace, true}
                                      : GemmStream{nullptr, state.workspace, kGemmWorkspace, true};
    newton_schulz(state, *l.batch, w, *l.hyper, l.split_from, on);
  }
}

void muon_cuda_step(const void* gemm, std::span<const MuonLaunch> launches, bool concurrent, bool graphs,
                    Stream stream, size_t slot) {
  auto& state = *static_cast<GemmState*>(const_cast<void*>(gemm));
  cuda::DeviceGuard guard(state.device);
  const cudaStream_t user = cuda::native(stream);
  cudaStreamCaptureStatus recording = cudaStreamCaptureStatusNone;
  GRADKIT_CUDA_CHECK(cudaStreamIsCapturing(user, &recording));
  if (state.recordings.size() <= slot) state.recordings.resize(slot + 1);
  GemmState::Recording& mine = state.recordings[slot];
  // The first step runs eagerly: cuBLASLt's algorithms are chosen and its
  // lazy initialisations happen outside a recording.
  if (!graphs || state.graphs_off || recording != cudaStreamCaptureStatusNone || !mine.stepped) {
    enqueue(state, launches, concurrent, user);
    mine.stepped = true;
    return;
  }
  GemmState::GraphKey key = graph_key(launches);
  if (mine.graph == nullptr || key != mine.key) {
    cudaGraphExec_t exec = record(state, launches, concurrent);
    if (exec == nullptr) {
      state.graphs_off = true;
      enqueue(state, launches, concurrent, user);
      return;
    }
    if (mine.graph) cudaGraphExecDestroy(mine.graph);
    mine.graph = exec;
    mine.key = std::move(key);
  }
  GRADKIT_CUDA_CHECK(cudaGraphLaunch(mine.graph, user));
}

void muon_cuda_beside(const void* gemm, std::span<const MuonLaunch> launches, bool concurrent, bool graphs,
                      Stream stream, size_t slot, size_t side) {
  const auto& state = *static_cast<const GemmState*>(gemm);
  cuda::DeviceGuard guard(state.device);
  const cudaStream_t on = state.sides.at(side);
  const GemmState::Beside& b = state.beside.at(slot);
  GRADKIT_CUDA_CHECK(cudaEventRecord(b.fork, cuda::native(stream)));
  GRADKIT_CUDA_CHECK(cudaStreamWaitEvent(on, b.fork, 0));
  if (!launches.empty()) muon_cuda_step(gemm, launches, concurrent, graphs, Stream{on}, slot);
  GRADKIT_CUDA_CHECK(cudaEventRecord(b.done, on));
}

void muon_cuda_join(const void* gemm, Stream stream, size_t slot) {
  const auto& state = *static_cast<const GemmState*>(gemm);
  cuda::DeviceGuard guard(state.device);
  GRADKIT_CUDA_CHECK(cudaStreamWaitEvent(cuda::native(stream), state.beside.at(slot).done, 0));
}

}  // namespace gradkit::spec
