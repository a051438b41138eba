// Vector add, the first kernel of chapter 11: the grid/block/thread model, coalescing, and
// 16-byte loads. Build: make -C csrc; run: csrc/build/vector_add [--check].
#include "common.cuh"
#include "harness.cuh"

// ---- BEGIN KERNELS ----
// c = a + b over n floats. Thread t of the grid owns elements 4t..4t+3: one 16-byte load from
// each input and one 16-byte store, so a warp moves 512 contiguous bytes per instruction (fully
// coalesced) and the kernel issues a quarter of the memory instructions of a float-at-a-time
// version. vec is false when a pointer is not 16-byte aligned; the last thread's group may run
// past n, so it takes the scalar path.
__global__ void vector_add_kernel(const float* a, const float* b, float* c, size_t n, bool vec) {
    const size_t i = 4 * (blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x);
    if (vec && i + 3 < n) {
        const float4 x = *reinterpret_cast<const float4*>(a + i);
        const float4 y = *reinterpret_cast<const float4*>(b + i);
        *reinterpret_cast<float4*>(c + i) = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
    } else {
        for (size_t j = i; j < i + 4 && j < n; ++j) c[j] = a[j] + b[j];
    }
}

constexpr int VECTOR_ADD_THREADS = 256;

cudaError_t launch_vector_add(const float* a, const float* b, float* c, size_t n, cudaStream_t stream) {
    if (n == 0) return cudaSuccess;
    const bool vec = aligned16(a) && aligned16(b) && aligned16(c);
    const size_t blocks = ceil_div(ceil_div(n, 4), VECTOR_ADD_THREADS);
    vector_add_kernel<<<blocks, VECTOR_ADD_THREADS, 0, stream>>>(a, b, c, n, vec);
    return cudaGetLastError();
}
// ---- END KERNELS ----

static bool check(size_t n, size_t offset) {
    // offset > 0 starts the arrays off 16-byte alignment, which must take the scalar path
    const auto a = random_vector(n + offset, 1), b = random_vector(n + offset, 2);
    DeviceBuffer<float> da(a), db(b), dc(n + offset);
    dc.poison();
    CUDA_CHECK(launch_vector_add(da.ptr + offset, db.ptr + offset, dc.ptr + offset, n, nullptr));
    const auto c = dc.download();
    std::vector<float> got(c.begin() + offset, c.end());
    std::vector<double> ref(n);
    for (size_t i = 0; i < n; ++i) ref[i] = static_cast<double>(a[i + offset]) + b[i + offset];
    char what[64];
    std::snprintf(what, sizeof what, "vector_add n=%zu offset=%zu", n, offset);
    return report(what, rel_error(got, ref), 1e-7);
}

int main(int argc, char** argv) {
    print_device("vector_add");
    bool ok = true;
    for (size_t n : {1, 17, 1023, 4097, 1000003}) ok &= check(n, 0);
    ok &= check(4097, 1);
    if (!check_only(argc, argv)) {
        const size_t n = size_t(1) << 26;  // 3 x 256 MB: far past the L2 cache
        DeviceBuffer<float> a(random_vector(n, 3)), b(random_vector(n, 4)), c(n);
        const float ms = time_ms([&] { return launch_vector_add(a.ptr, b.ptr, c.ptr, n, nullptr); });
        std::printf("  vector_add n=%zu: %.3f ms, %.0f GB/s (12 bytes per element)\n", n, ms, 12.0 * n / ms / 1e6);
    }
    std::printf("%s\n", ok ? "PASS" : "FAIL");
    return ok ? 0 : 1;
}
