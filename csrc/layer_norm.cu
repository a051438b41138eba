// Layer norm over the last dimension with Welford's mean and variance, chapter 13.
// Build: make -C csrc; run: csrc/build/layer_norm [--check].
#include "common.cuh"
#include "harness.cuh"

// ---- BEGIN KERNELS ----
// Welford's algorithm keeps (count, mean, M2 = sum of squared deviations from the mean) and
// updates it one value at a time. It never forms E[x^2] - E[x]^2, the difference of two large,
// nearly equal numbers that loses every digit of the variance when |mean| >> std. Two partial
// states merge exactly (Chan et al.), so the block combines its threads' states with the same
// shuffle reduction as a sum.
struct Welford {
    float n, mean, m2;
};

__device__ __forceinline__ Welford shfl_xor(Welford v, int lane_mask) {
    return {shfl_xor(v.n, lane_mask), shfl_xor(v.mean, lane_mask), shfl_xor(v.m2, lane_mask)};
}

struct WelfordOp {
    __device__ static Welford identity() { return {0.0f, 0.0f, 0.0f}; }
    __device__ static Welford combine(Welford a, Welford b) {
        const float n = a.n + b.n;
        if (n == 0.0f) return a;
        const float delta = b.mean - a.mean, wb = b.n / n;
        return {n, a.mean + delta * wb, a.m2 + b.m2 + delta * delta * a.n * wb};
    }
};

// One block per row, the row held in registers (n <= ROW_REG_MAX). Each thread's (count, mean, M2)
// comes from its own values in two passes over registers (mean first, then squared deviations
// from it: no cancellation); the block merges them with the Welford/Chan rule, and each thread
// writes (x - mean) / sqrt(var + eps) * weight + bias, with the biased variance that torch and
// GPT-2 use. weight and bias are read group by group as the output is written (every block reads
// them, so they come from L1/L2): holding them in registers too would cost occupancy.
__global__ void __launch_bounds__(ROW_THREADS_MAX)
    layer_norm_kernel(const float* x, const float* weight, const float* bias, float* y, int n, float eps, bool vec,
                      bool vec_wb) {
    const float* xr = x + static_cast<size_t>(blockIdx.x) * n;
    float* yr = y + static_cast<size_t>(blockIdx.x) * n;
    float v[4 * ROW_CHUNKS];
    load_row(xr, n, vec, v, 0.0f);
    float count = 0.0f, sum = 0.0f;
#pragma unroll
    for (int c = 0; c < ROW_CHUNKS; ++c) {
        const int j = threadIdx.x + c * blockDim.x;
        count += static_cast<float>(max(0, min(4, n - 4 * j)));  // the padding is 0: it adds nothing to sum
#pragma unroll
        for (int e = 0; e < 4; ++e) sum += v[4 * c + e];
    }
    const float mean_t = count > 0.0f ? sum / count : 0.0f;
    float m2 = 0.0f;
#pragma unroll
    for (int c = 0; c < ROW_CHUNKS; ++c) {
        const int j = threadIdx.x + c * blockDim.x;
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (4 * j + e < n) m2 += (v[4 * c + e] - mean_t) * (v[4 * c + e] - mean_t);
    }
    const Welford stats = block_allreduce<WelfordOp>(Welford{count, mean_t, m2});
    const float mean = stats.mean, rstd = rsqrtf(stats.m2 / stats.n + eps);
#pragma unroll
    for (int c = 0; c < ROW_CHUNKS; ++c) {
        const int j = threadIdx.x + c * blockDim.x;
        if (4 * j >= n) break;
        float w[4], b[4], out[4];
        load_group(weight, n, vec_wb, j, w, 0.0f);
        load_group(bias, n, vec_wb, j, b, 0.0f);
#pragma unroll
        for (int e = 0; e < 4; ++e) out[e] = (v[4 * c + e] - mean) * rstd * w[e] + b[e];
        store_group(yr, n, vec, j, out);
    }
}

// Rows longer than ROW_REG_MAX: pass 1 streams the row into the thread's Welford state, one value
// at a time; pass 2 reads it again (mostly from L2) and writes.
__global__ void layer_norm_streamed_kernel(const float* x, const float* weight, const float* bias, float* y, int n,
                                           float eps, bool vec) {
    const float* xr = x + static_cast<size_t>(blockIdx.x) * n;
    float* yr = y + static_cast<size_t>(blockIdx.x) * n;
    Welford stats = WelfordOp::identity();
    row_for_each(xr, n, vec, [&](int, float v) {
        stats.n += 1.0f;
        const float delta = v - stats.mean;
        stats.mean += delta / stats.n;
        stats.m2 += delta * (v - stats.mean);
    });
    stats = block_allreduce<WelfordOp>(stats);
    const float mean = stats.mean, rstd = rsqrtf(stats.m2 / stats.n + eps);
    row_map(xr, yr, n, vec, [&](int i, float v) { return (v - mean) * rstd * weight[i] + bias[i]; });
}

// y[r, :] = layer_norm(x[r, :]) * weight + bias for r < rows; weight and bias hold n floats.
cudaError_t launch_layer_norm(const float* x, const float* weight, const float* bias, float* y, size_t rows, int n,
                              float eps, cudaStream_t stream) {
    if (rows == 0 || n == 0) return cudaSuccess;
    const bool vec = n % 4 == 0 && aligned16(x) && aligned16(y);
    if (n <= ROW_REG_MAX)
        layer_norm_kernel<<<rows, row_block_threads(n), 0, stream>>>(x, weight, bias, y, n, eps, vec,
                                                                     vec && aligned16(weight) && aligned16(bias));
    else
        layer_norm_streamed_kernel<<<rows, 1024, 0, stream>>>(x, weight, bias, y, n, eps, vec);
    return cudaGetLastError();
}
// ---- END KERNELS ----

static bool check(size_t rows, int n, float offset) {
    // offset 1000 puts the mean far from zero, where E[x^2] - E[x]^2 would lose the variance
    auto x = random_vector(rows * n, rows * 5 + n, offset - 1.0f, offset + 1.0f);
    const auto w = random_vector(n, 11), b = random_vector(n, 12);
    const float eps = 1e-5f;
    DeviceBuffer<float> dx(x), dw(w), db(b), dy(rows * n);
    dy.poison();
    CUDA_CHECK(launch_layer_norm(dx.ptr, dw.ptr, db.ptr, dy.ptr, rows, n, eps, nullptr));
    std::vector<double> ref(rows * n);
    for (size_t r = 0; r < rows; ++r) {
        double mean = 0.0, var = 0.0;
        for (int i = 0; i < n; ++i) mean += x[r * n + i];
        mean /= n;
        for (int i = 0; i < n; ++i) var += (x[r * n + i] - mean) * (x[r * n + i] - mean);
        var /= n;
        for (int i = 0; i < n; ++i) ref[r * n + i] = (x[r * n + i] - mean) / std::sqrt(var + eps) * w[i] + b[i];
    }
    char what[64];
    std::snprintf(what, sizeof what, "layer_norm rows=%zu n=%d offset=%g", rows, n, offset);
    // near 1000 the float32 running mean is held to ~6e-5 absolute, 1e-4 of the std: a looser tolerance
    return report(what, rel_error(dy.download(), ref), offset == 0.0f ? 1e-5 : 1e-3);
}

int main(int argc, char** argv) {
    print_device("layer_norm");
    bool ok = true;
    const size_t shapes[][2] = {{1, 1}, {17, 1023}, {3, 4097}, {1023, 17}, {5, 8192}, {5, 8193}, {3, 16384}, {3, 16385}, {2, 50257}};
    for (const auto& s : shapes) ok &= check(s[0], static_cast<int>(s[1]), 0.0f);
    ok &= check(7, 768, 1000.0f);
    if (!check_only(argc, argv)) {
        const size_t rows = 16384;
        const int n = 4096;
        DeviceBuffer<float> x(random_vector(rows * n, 7)), w(random_vector(n, 8)), b(random_vector(n, 9)), y(rows * n);
        auto launch = [&] { return launch_layer_norm(x.ptr, w.ptr, b.ptr, y.ptr, rows, n, 1e-5f, nullptr); };
        const float ms = time_ms(launch);
        std::printf("  layer_norm %zux%d: %.3f ms, %.0f GB/s (8 bytes per element)\n", rows, n, ms,
                    8.0 * rows * n / ms / 1e6);
    }
    std::printf("%s\n", ok ? "PASS" : "FAIL");
    return ok ? 0 : 1;
}
