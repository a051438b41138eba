// Softmax over the last dimension, chapter 13: the online (one-pass) max-and-sum, numerically
// safe. Build: make -C csrc; run: csrc/build/softmax [--check].
#include "common.cuh"
#include "harness.cuh"

// ---- BEGIN KERNELS ----
// softmax(x)_i = exp(x_i - m) / sum_j exp(x_j - m) with m = max_j x_j: subtracting the maximum
// keeps every exp() in (0, 1], so large logits cannot overflow to inf (exp(89) already does in
// float32). The online form (Milakov and Gimelshein, 2018) finds m and the sum in one pass: it
// keeps a running maximum and rescales the sum so far by exp(m_old - m_new) whenever it grows.
struct MaxSum {
    float m;  // running maximum
    float s;  // sum of exp(x - m) over the values seen
};

__device__ __forceinline__ MaxSum shfl_xor(MaxSum v, int lane_mask) {
    return {shfl_xor(v.m, lane_mask), shfl_xor(v.s, lane_mask)};
}

struct OnlineSoftmaxOp {
    __device__ static MaxSum identity() { return {-INFINITY, 0.0f}; }
    __device__ static MaxSum combine(MaxSum a, MaxSum b) {
        const float m = fmaxf(a.m, b.m);
        if (m == -INFINITY) return {m, 0.0f};  // nothing seen on either side: avoid exp(-inf + inf) = NaN
        return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
    }
};

// One block per row, the row held in registers (n <= ROW_REG_MAX): each thread takes the max of
// its own values and the sum of exp(x - max) over them, the block merges the threads' (m, s)
// pairs with the online rule, and each thread writes exp(x - m) / s from its registers. One read
// and one write of the row, the minimum.
__global__ void __launch_bounds__(ROW_THREADS_MAX) softmax_kernel(const float* x, float* y, int n, bool vec) {
    const float* xr = x + static_cast<size_t>(blockIdx.x) * n;
    float* yr = y + static_cast<size_t>(blockIdx.x) * n;
    float v[4 * ROW_CHUNKS];
    load_row(xr, n, vec, v, -INFINITY);  // exp(-inf - m) = 0: the padding adds nothing
    float m = -INFINITY, s = 0.0f;
#pragma unroll
    for (int k = 0; k < 4 * ROW_CHUNKS; ++k) m = fmaxf(m, v[k]);
    if (m != -INFINITY) {
#pragma unroll
        for (int k = 0; k < 4 * ROW_CHUNKS; ++k) s += expf(v[k] - m);
    }
    const MaxSum t = block_allreduce<OnlineSoftmaxOp>(MaxSum{m, s});
    const float inv_sum = 1.0f / t.s;
#pragma unroll
    for (int c = 0; c < ROW_CHUNKS; ++c) {
        float out[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) out[e] = expf(v[4 * c + e] - t.m) * inv_sum;
        store_group(yr, n, vec, threadIdx.x + c * blockDim.x, out);
    }
}

// Rows longer than ROW_REG_MAX: pass 1 streams the row into the online (m, s), one element at a
// time; pass 2 reads it again (mostly from L2) and writes. 1.5x the minimum traffic.
__global__ void softmax_streamed_kernel(const float* x, float* y, int n, bool vec) {
    const float* xr = x + static_cast<size_t>(blockIdx.x) * n;
    float* yr = y + static_cast<size_t>(blockIdx.x) * n;
    MaxSum t = OnlineSoftmaxOp::identity();
    row_for_each(xr, n, vec, [&](int, float v) {
        if (v > t.m) {  // a new maximum: rescale the sum so far (one exp per element either way)
            t.s = t.s * expf(t.m - v) + 1.0f;
            t.m = v;
        } else if (t.m != -INFINITY) {
            t.s += expf(v - t.m);
        }
    });
    t = block_allreduce<OnlineSoftmaxOp>(t);
    const float inv_sum = 1.0f / t.s;
    row_map(xr, yr, n, vec, [&](int, float v) { return expf(v - t.m) * inv_sum; });
}

// y[r, :] = softmax(x[r, :]) for r < rows. A row of only -inf gives NaN, as torch.softmax does.
cudaError_t launch_softmax(const float* x, float* y, size_t rows, int n, cudaStream_t stream) {
    if (rows == 0 || n == 0) return cudaSuccess;
    const bool vec = n % 4 == 0 && aligned16(x) && aligned16(y);
    if (n <= ROW_REG_MAX) softmax_kernel<<<rows, row_block_threads(n), 0, stream>>>(x, y, n, vec);
    else softmax_streamed_kernel<<<rows, 1024, 0, stream>>>(x, y, n, vec);
    return cudaGetLastError();
}
// ---- END KERNELS ----

static bool check(size_t rows, int n, float scale) {
    // scale 100 makes logits whose exp() overflows float32 unless the maximum is subtracted
    auto x = random_vector(rows * n, rows * 7 + n, -scale, scale);
    DeviceBuffer<float> dx(x), dy(rows * n);
    dy.poison();
    CUDA_CHECK(launch_softmax(dx.ptr, dy.ptr, rows, n, nullptr));
    std::vector<double> ref(rows * n);
    for (size_t r = 0; r < rows; ++r) {
        double m = -INFINITY, s = 0.0;
        for (int i = 0; i < n; ++i) m = std::max(m, static_cast<double>(x[r * n + i]));
        for (int i = 0; i < n; ++i) s += std::exp(x[r * n + i] - m);
        for (int i = 0; i < n; ++i) ref[r * n + i] = std::exp(x[r * n + i] - m) / s;
    }
    char what[64];
    std::snprintf(what, sizeof what, "softmax rows=%zu n=%d scale=%g", rows, n, scale);
    return report(what, rel_error(dy.download(), ref), 1e-5);
}

int main(int argc, char** argv) {
    print_device("softmax");
    bool ok = true;
    const size_t shapes[][2] = {{1, 1}, {17, 1023}, {3, 4097}, {1023, 17}, {5, 8192}, {5, 8193}, {3, 16384}, {3, 16385}, {2, 50257}};
    for (const auto& s : shapes) ok &= check(s[0], static_cast<int>(s[1]), 4.0f);
    ok &= check(7, 1000, 100.0f);
    if (!check_only(argc, argv)) {
        const size_t rows = 16384;
        const int n = 4096;  // 256 MB in, 256 MB out
        DeviceBuffer<float> x(random_vector(rows * n, 6, -4.0f, 4.0f)), y(rows * n);
        const float ms = time_ms([&] { return launch_softmax(x.ptr, y.ptr, rows, n, nullptr); });
        std::printf("  softmax %zux%d: %.3f ms, %.0f GB/s (8 bytes per element)\n", rows, n, ms,
                    8.0 * rows * n / ms / 1e6);
    }
    std::printf("%s\n", ok ? "PASS" : "FAIL");
    return ok ? 0 : 1;
}
