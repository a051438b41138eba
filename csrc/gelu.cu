// GELU (GPT-2's tanh form) and the fused bias + GELU, chapter 13.
// Build: make -C csrc; run: csrc/build/gelu [--check].
#include "common.cuh"
#include "harness.cuh"

// ---- BEGIN KERNELS ----
// GPT-2's GELU: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
__device__ __forceinline__ float gelu_tanh(float x) {
    const float k0 = 0.7978845608028654f, k1 = 0.044715f;
    return 0.5f * x * (1.0f + tanhf(k0 * (x + k1 * x * x * x)));
}

// y = gelu(x + bias[column]) over a (rows, cols) matrix of n floats; bias may be null (plain
// GELU). Unfused, `h = x + bias; y = gelu(h)` reads and writes the matrix twice (16 bytes per
// element); fused, the sum stays in a register: 8 bytes per element, half the time for a
// memory-bound op. Thread t owns elements 4t..4t+3 with 16-byte loads and stores, as in
// vector_add; vec needs aligned pointers and cols % 4 == 0 (the four share a row).
__global__ void bias_gelu_kernel(const float* x, const float* bias, float* y, size_t n, int cols, bool vec) {
    const size_t i = 4 * (blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x);
    if (vec && i + 3 < n) {
        float4 v = *reinterpret_cast<const float4*>(x + i);
        if (bias != nullptr) {
            const float4 b = *reinterpret_cast<const float4*>(bias + i % cols);
            v = make_float4(v.x + b.x, v.y + b.y, v.z + b.z, v.w + b.w);
        }
        *reinterpret_cast<float4*>(y + i) = make_float4(gelu_tanh(v.x), gelu_tanh(v.y), gelu_tanh(v.z), gelu_tanh(v.w));
    } else {
        for (size_t j = i; j < i + 4 && j < n; ++j) y[j] = gelu_tanh(x[j] + (bias != nullptr ? bias[j % cols] : 0.0f));
    }
}

constexpr int GELU_THREADS = 256;

cudaError_t launch_bias_gelu(const float* x, const float* bias, float* y, size_t n, int cols, cudaStream_t stream) {
    if (n == 0) return cudaSuccess;
    const bool vec = aligned16(x) && aligned16(y) && (bias == nullptr || (aligned16(bias) && cols % 4 == 0));
    bias_gelu_kernel<<<ceil_div(ceil_div(n, 4), GELU_THREADS), GELU_THREADS, 0, stream>>>(x, bias, y, n, cols, vec);
    return cudaGetLastError();
}
// ---- END KERNELS ----

static double gelu_ref(double x) {
    return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

static bool check(size_t rows, int cols, bool with_bias) {
    const size_t n = rows * cols;
    const auto x = random_vector(n, n + cols, -6.0f, 6.0f), b = random_vector(cols, 13);
    DeviceBuffer<float> dx(x), db(b), dy(n);
    dy.poison();
    CUDA_CHECK(launch_bias_gelu(dx.ptr, with_bias ? db.ptr : nullptr, dy.ptr, n, cols, nullptr));
    std::vector<double> ref(n);
    for (size_t i = 0; i < n; ++i) ref[i] = gelu_ref(static_cast<double>(x[i]) + (with_bias ? b[i % cols] : 0.0f));
    char what[64];
    std::snprintf(what, sizeof what, "%s rows=%zu cols=%d", with_bias ? "bias_gelu" : "gelu", rows, cols);
    return report(what, rel_error(dy.download(), ref), 1e-6);
}

int main(int argc, char** argv) {
    print_device("gelu");
    bool ok = true;
    const size_t shapes[][2] = {{1, 1}, {17, 1023}, {3, 4097}, {1023, 17}, {64, 3072}};
    for (const auto& s : shapes)
        for (bool with_bias : {false, true}) ok &= check(s[0], static_cast<int>(s[1]), with_bias);
    if (!check_only(argc, argv)) {
        const size_t rows = 16384;
        const int cols = 4096;
        DeviceBuffer<float> x(random_vector(rows * cols, 10)), b(random_vector(cols, 11)), y(rows * cols);
        for (bool with_bias : {false, true}) {
            const float* bias = with_bias ? b.ptr : nullptr;
            const float ms = time_ms([&] { return launch_bias_gelu(x.ptr, bias, y.ptr, rows * cols, cols, nullptr); });
            std::printf("  %-9s %zux%d: %.3f ms, %.0f GB/s (8 bytes per element)\n", with_bias ? "bias_gelu" : "gelu",
                        rows, cols, ms, 8.0 * rows * cols / ms / 1e6);
        }
    }
    std::printf("%s\n", ok ? "PASS" : "FAIL");
    return ok ? 0 : 1;
}
