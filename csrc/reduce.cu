// Reductions over the last dimension (sum and max), chapter 13: naive atomics, a shared-memory
// tree, and warp shuffles. Build: make -C csrc; run: csrc/build/reduce [--check].
#include "common.cuh"
#include "harness.cuh"

// ---- BEGIN KERNELS ----
struct SumOp {
    __device__ static float identity() { return 0.0f; }
    __device__ static float combine(float a, float b) { return a + b; }
    __device__ static void atomic_combine(float* dst, float v) { atomicAdd(dst, v); }
};

struct MaxOp {
    __device__ static float identity() { return -INFINITY; }
    __device__ static float combine(float a, float b) { return fmaxf(a, b); }
    // There is no float atomicMax, but floats of one sign order like their bit patterns: as signed
    // ints when the sign bit is clear, in reverse as unsigned ints when it is set.
    __device__ static void atomic_combine(float* dst, float v) {
        if (__float_as_int(v) >= 0) atomicMax(reinterpret_cast<int*>(dst), __float_as_int(v));
        else atomicMin(reinterpret_cast<unsigned int*>(dst), __float_as_uint(v));
    }
};

constexpr int REDUCE_THREADS = 256;  // a power of two: the tree halves it
constexpr int REDUCE_CHUNK = 8192;   // elements one block reduces: 8 float4 loads per thread

template <class Op>
__global__ void reduce_init_kernel(float* out, size_t rows) {
    const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
    if (i < rows) out[i] = Op::identity();
}

// Method "atomic": one thread per element, each combined straight into out[row] with an atomic.
// Simple and correct, but all the threads of a row queue on one address in L2, and the order of
// the additions (so the rounding of a sum) changes from run to run.
template <class Op>
__global__ void reduce_atomic_kernel(const float* x, float* out, size_t total, int n) {
    const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
    if (i < total) Op::atomic_combine(&out[i / n], x[i]);
}

// Method "tree": the block's values go to shared memory and are halved in log2(256) = 8 steps,
// a barrier after each; sequential addressing (thread t adds t + stride) keeps the warps' accesses
// free of bank conflicts.
template <class Op>
__device__ float block_reduce_tree(float v) {
    __shared__ float buf[REDUCE_THREADS];
    buf[threadIdx.x] = v;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
        if (threadIdx.x < stride) buf[threadIdx.x] = Op::combine(buf[threadIdx.x], buf[threadIdx.x + stride]);
        __syncthreads();
    }
    return buf[0];
}

// Methods "tree" and "shuffle" share this kernel: block b reduces chunk (b % chunks) of row
// (b / chunks), REDUCE_CHUNK elements, into out[b]. Each thread first folds its own elements in
// registers (16-byte coalesced loads, several in flight); only the last step, 256 values to one,
// differs: shared-memory tree or warp shuffles (5 register exchanges per warp, one barrier).
template <class Op, bool SHUFFLE>
__global__ void __launch_bounds__(REDUCE_THREADS) reduce_rows_kernel(const float* x, float* out, int n, bool vec) {
    const int chunks = static_cast<int>(ceil_div(n, REDUCE_CHUNK));
    const size_t row = blockIdx.x / chunks;
    const int start = (blockIdx.x % chunks) * REDUCE_CHUNK;
    const int len = min(REDUCE_CHUNK, n - start);
    float acc = Op::identity();
    row_for_each(x + row * n + start, len, vec, [&](int, float v) { acc = Op::combine(acc, v); });
    if constexpr (SHUFFLE) acc = block_allreduce<Op>(acc);
    else acc = block_reduce_tree<Op>(acc);
    if (threadIdx.x == 0) out[blockIdx.x] = acc;
}

enum ReduceMethod { REDUCE_ATOMIC = 0, REDUCE_TREE = 1, REDUCE_SHUFFLE = 2 };

// A row longer than REDUCE_CHUNK is reduced in passes: rows x chunks partial results, then those
// reduced again, until one value per row is left. The partials need this many floats of workspace.
inline size_t reduce_workspace_floats(size_t rows, int n) {
    size_t floats = 0;
    for (size_t chunks = ceil_div(n, REDUCE_CHUNK); chunks > 1; chunks = ceil_div(chunks, REDUCE_CHUNK))
        floats += rows * chunks;
    return floats;
}

template <class Op>
cudaError_t launch_reduce_op(const float* x, float* out, float* workspace, size_t rows, int n, int method,
                             cudaStream_t stream) {
    if (method == REDUCE_ATOMIC) {
        const size_t total = rows * n;
        reduce_init_kernel<Op><<<ceil_div(rows, REDUCE_THREADS), REDUCE_THREADS, 0, stream>>>(out, rows);
        reduce_atomic_kernel<Op><<<ceil_div(total, REDUCE_THREADS), REDUCE_THREADS, 0, stream>>>(x, out, total, n);
        return cudaGetLastError();
    }
    const float* src = x;
    for (;;) {
        const int chunks = static_cast<int>(ceil_div(n, REDUCE_CHUNK));
        float* dst = chunks == 1 ? out : workspace;
        const bool vec = n % 4 == 0 && aligned16(src);
        const size_t blocks = rows * chunks;
        if (method == REDUCE_TREE)
            reduce_rows_kernel<Op, false><<<blocks, REDUCE_THREADS, 0, stream>>>(src, dst, n, vec);
        else
            reduce_rows_kernel<Op, true><<<blocks, REDUCE_THREADS, 0, stream>>>(src, dst, n, vec);
        if (chunks == 1) break;
        src = dst;
        workspace += rows * chunks;
        n = chunks;
    }
    return cudaGetLastError();
}

// out[r] = sum (or max) of x[r, 0:n] for r < rows; workspace: reduce_workspace_floats(rows, n).
cudaError_t launch_reduce(const float* x, float* out, float* workspace, size_t rows, int n, bool max, int method,
                          cudaStream_t stream) {
    if (rows == 0 || n == 0) return cudaSuccess;
    return max ? launch_reduce_op<MaxOp>(x, out, workspace, rows, n, method, stream)
               : launch_reduce_op<SumOp>(x, out, workspace, rows, n, method, stream);
}
// ---- END KERNELS ----

static const char* method_name(int method) {
    return method == REDUCE_ATOMIC ? "atomic" : method == REDUCE_TREE ? "tree" : "shuffle";
}

// Sums are measured against float64 relative to sum |x| (the scale of the rounding error of any
// summation order); maxima must be exact.
static bool check(size_t rows, int n, bool max, int method) {
    const auto x = random_vector(rows * n, rows * 131 + n);
    DeviceBuffer<float> dx(x), out(rows), ws(std::max<size_t>(reduce_workspace_floats(rows, n), 1));
    out.poison();
    CUDA_CHECK(launch_reduce(dx.ptr, out.ptr, ws.ptr, rows, n, max, method, nullptr));
    CUDA_CHECK(cudaDeviceSynchronize());
    const auto got = out.download();
    double worst = 0.0;
    for (size_t r = 0; r < rows; ++r) {
        double ref = max ? -INFINITY : 0.0, scale = 0.0;
        for (int i = 0; i < n; ++i) {
            const double v = x[r * n + i];
            ref = max ? std::max(ref, v) : ref + v;
            scale += std::fabs(v);
        }
        const double err = std::isnan(got[r]) ? INFINITY : std::fabs(got[r] - ref) / (max ? 1.0 : scale);
        worst = std::max(worst, err);
    }
    char what[80];
    std::snprintf(what, sizeof what, "reduce_%s %s rows=%zu n=%d", max ? "max" : "sum", method_name(method), rows, n);
    return report(what, worst, max ? 0.0 : 1e-6);
}

int main(int argc, char** argv) {
    print_device("reduce");
    bool ok = true;
    const size_t shapes[][2] = {{1, 1}, {17, 1023}, {3, 4097}, {1023, 17}, {2, 100003}};
    for (const auto& s : shapes)
        for (bool max : {false, true})
            for (int method : {REDUCE_ATOMIC, REDUCE_TREE, REDUCE_SHUFFLE})
                ok &= check(s[0], static_cast<int>(s[1]), max, method);
    if (!check_only(argc, argv)) {
        const size_t rows = 8192;
        const int n = 8192;  // 256 MB: far past the L2 cache
        DeviceBuffer<float> x(random_vector(rows * n, 5)), out(rows), ws(1);
        for (bool max : {false, true})
            for (int method : {REDUCE_ATOMIC, REDUCE_TREE, REDUCE_SHUFFLE}) {
                auto launch = [&] { return launch_reduce(x.ptr, out.ptr, ws.ptr, rows, n, max, method, nullptr); };
                const float ms = time_ms(launch);
                std::printf("  reduce_%s %-7s %zux%d: %.3f ms, %.0f GB/s\n", max ? "max" : "sum", method_name(method),
                            rows, n, ms, 4.0 * rows * n / ms / 1e6);
            }
    }
    std::printf("%s\n", ok ? "PASS" : "FAIL");
    return ok ? 0 : 1;
}
