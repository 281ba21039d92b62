// CPU emulation of the CUDA that TVM emits for a mexc training step (docs/cuda.md, "Emulated on
// the CPU"). Included before the kernels of one artifact module (step<i>.cu with TVM's preamble
// cut off) and compiled with g++ into a shared library that mexc.backends.cuda.emulator drives.
//
// Model: one block at a time; its threads run as fibers on one OS thread, switching only at
// __syncthreads and warp collectives, so the kernels' own barriers order their shared
// memory exactly as on a GPU. Kernels without a barrier or collective run their threads as plain
// calls, one after another. __shared__ arrays are function statics: one block runs at a time.
// A WMMA fragment is held whole by every lane of its warp; mma_sync computes the rows a lane
// owns (row r belongs to lane r % 32) and store_matrix_sync writes them, so each element is
// computed and stored once per warp. Shuffles exchange through per-thread slots across one
// warp barrier. Integer semantics follow the GPU: -fwrapv (two's-complement wrap) and
// -fno-strict-aliasing (TVM reinterprets pointers); no floating point is used here.
#pragma once
#include <setjmp.h>
#include <ucontext.h>

#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __inline__ inline
#define __launch_bounds__(...)
#define __shared__ static
typedef unsigned int uint;  // as glibc's; TVM's source casts with these names
typedef unsigned short ushort;
typedef unsigned char uchar;

struct dim3 {
    unsigned int x, y, z;
};
struct alignas(8) int2 {
    int x, y;
};
struct alignas(16) int4 {
    int x, y, z, w;
};
struct alignas(4) char4 {
    signed char x, y, z, w;
};

namespace mexc_emu {

enum Wait { RUNNABLE = 0, AT_BLOCK_BARRIER, AT_WARP_BARRIER, DONE };

// A fiber starts once through its ucontext (its own stack) and from then on switches with
// _setjmp/_longjmp, which, unlike swapcontext, save no signal mask: no system call per switch.
struct Fiber {
    ucontext_t start;
    jmp_buf at;
    bool started;
    int linear;  // x fastest, then y, then z
    int wait;
    unsigned shuffles;  // collectives this thread has done: picks the slot buffer
};

struct Launch {
    void* fn;
    int nargs;
    void** args;
    dim3 grid, block;
    int threads;
    std::vector<Fiber> fibers;
    std::vector<std::vector<char>> stacks;
    std::vector<uint64_t> slots[2];  // per thread, double-buffered: one barrier per shuffle
    jmp_buf scheduler;
    Fiber* current;
    const char* error;
    bool reverse;  // run blocks and threads in reverse order (exposes races between them)
};

inline Launch g;  // one launch at a time per module
inline dim3 g_thread, g_block;
inline int g_linear;

constexpr int WARP = 32;
constexpr size_t STACK_BYTES = 256 * 1024;

inline int lane() { return g_linear % WARP; }
inline int warp() { return g_linear / WARP; }

// Suspend the running fiber at a barrier; the scheduler resumes it when the barrier releases.
inline void wait_at(int kind) {
    if (g.current == nullptr) {
        g.error = "a barrier or warp collective ran outside a fiber (kernel not marked as syncing)";
        return;
    }
    g.current->wait = kind;
    if (_setjmp(g.current->at) == 0) _longjmp(g.scheduler, 1);
}

}  // namespace mexc_emu

#define threadIdx (mexc_emu::g_thread)
#define blockIdx (mexc_emu::g_block)
#define blockDim (mexc_emu::g.block)
#define gridDim (mexc_emu::g.grid)
#define warpSize 32

inline void __syncthreads() { mexc_emu::wait_at(mexc_emu::AT_BLOCK_BARRIER); }
inline void __syncwarp(unsigned = 0xffffffffu) { mexc_emu::wait_at(mexc_emu::AT_WARP_BARRIER); }
// no __activemask(): the build writes every shuffle's mask in (mexc/backends/cuda/source.py)

template <class T>
inline T mexc_emu_exchange(T v, int src, unsigned mask) {
    static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
    using namespace mexc_emu;
    if (g.current == nullptr) {
        g.error = "a warp collective ran outside a fiber (kernel not marked as syncing)";
        return v;
    }
    // a GPU leaves a shuffle undefined when the caller or its source lane is not in the mask
    if (!((mask >> lane()) & 1u) || !((mask >> (src % WARP)) & 1u)) {
        g.error = "a warp shuffle whose mask leaves out its own or its source lane";
        return v;
    }
    // Buffers alternate per collective: a lane writes buffer b again only two collectives
    // later, after a barrier that every lane reaches after reading b.
    std::vector<uint64_t>& slots = g.slots[g.current->shuffles++ & 1];
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    slots[g_linear] = bits;
    wait_at(AT_WARP_BARRIER);  // every active lane has written its slot
    T out;
    bits = slots[warp() * WARP + src];
    std::memcpy(&out, &bits, sizeof(T));
    return out;
}

template <class T>
inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
    int l = mexc_emu::lane();
    return mexc_emu_exchange(v, (l / width) * width + (src_lane % width), mask);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    int l = mexc_emu::lane();
    int src = (l % width) + int(delta) < width ? l + int(delta) : l;
    return mexc_emu_exchange(v, src, mask);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    int l = mexc_emu::lane();
    int src = (l % width) >= int(delta) ? l - int(delta) : l;
    return mexc_emu_exchange(v, src, mask);
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    int l = mexc_emu::lane();
    int src = l ^ lane_mask;
    return mexc_emu_exchange(v, (src / width == l / width) ? src : l, mask);
}

template <class A, class B>
inline std::common_type_t<A, B> min(A a, B b) {
    using C = std::common_type_t<A, B>;
    return C(a) < C(b) ? C(a) : C(b);
}
template <class A, class B>
inline std::common_type_t<A, B> max(A a, B b) {
    using C = std::common_type_t<A, B>;
    return C(a) > C(b) ? C(a) : C(b);
}

// dp4a: four 8-bit products summed into a 32-bit accumulator (wrapping, as the hardware).
template <bool SA, bool SB>
inline int mexc_emu_dp4a(unsigned a, unsigned b, int c) {
    uint32_t acc = uint32_t(c);
    for (int i = 0; i < 4; ++i) {
        unsigned ba = (a >> (8 * i)) & 0xffu, bb = (b >> (8 * i)) & 0xffu;
        int va = SA ? int(int8_t(ba)) : int(ba), vb = SB ? int(int8_t(bb)) : int(bb);
        acc += uint32_t(va * vb);
    }
    return int(acc);
}
inline int __dp4a(int a, int b, int c) { return mexc_emu_dp4a<true, true>(a, b, c); }
inline int __dp4a(unsigned a, int b, int c) { return mexc_emu_dp4a<false, true>(a, b, c); }
inline int __dp4a(int a, unsigned b, int c) { return mexc_emu_dp4a<true, false>(a, b, c); }
inline unsigned __dp4a(unsigned a, unsigned b, unsigned c) {
    return unsigned(mexc_emu_dp4a<false, false>(a, b, int(c)));
}

// the tile operations are the emulator's inner loops: optimized whatever the kernels' -O level
#define MEXC_EMU_HOT __attribute__((optimize("O3")))

namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K>
struct shape_of;
template <int M, int N, int K>
struct shape_of<matrix_a, M, N, K> {
    static constexpr int rows = M, cols = K;
};
template <int M, int N, int K>
struct shape_of<matrix_b, M, N, K> {
    static constexpr int rows = K, cols = N;
};
template <int M, int N, int K>
struct shape_of<accumulator, M, N, K> {
    static constexpr int rows = M, cols = N;
};

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
    static constexpr int rows = shape_of<Use, M, N, K>::rows, cols = shape_of<Use, M, N, K>::cols;
    T v[rows][cols];
};

template <class Use, int M, int N, int K, class T, class L, class V>
inline void fill_fragment(fragment<Use, M, N, K, T, L>& f, const V& value) {
    for (auto& row : f.v)
        for (auto& x : row) x = T(value);
}

// matrix_a rows are loaded by the lanes that own them (mma_sync reads no other); matrix_b whole.
template <class Use, int M, int N, int K, class T, class L>
MEXC_EMU_HOT inline void load_matrix_sync(fragment<Use, M, N, K, T, L>& f, const T* p,
                                          unsigned ldm) {
    constexpr bool col = std::is_same_v<L, col_major>;
    constexpr bool by_owner = std::is_same_v<Use, matrix_a>;
    const int first = by_owner ? mexc_emu::lane() : 0, step = by_owner ? mexc_emu::WARP : 1;
    for (int r = first; r < f.rows; r += step)
        for (int c = 0; c < f.cols; ++c) f.v[r][c] = col ? p[c * ldm + r] : p[r * ldm + c];
}

template <int M, int N, int K, class T>
inline void load_matrix_sync(fragment<accumulator, M, N, K, T, void>& f, const T* p, unsigned ldm,
                             layout_t layout) {
    for (int r = 0; r < M; ++r)
        for (int c = 0; c < N; ++c)
            f.v[r][c] = layout == mem_col_major ? p[c * ldm + r] : p[r * ldm + c];
}

// Rows r with r % 32 == lane: each accumulator element is computed by one lane of the warp.
template <int M, int N, int K, class TA, class LA, class TB, class LB, class TC>
MEXC_EMU_HOT inline void mma_sync(fragment<accumulator, M, N, K, TC, void>& d,
                                  const fragment<matrix_a, M, N, K, TA, LA>& a,
                                  const fragment<matrix_b, M, N, K, TB, LB>& b,
                                  const fragment<accumulator, M, N, K, TC, void>& c) {
    for (int r = mexc_emu::lane(); r < M; r += mexc_emu::WARP) {
        uint32_t acc[N];
        for (int j = 0; j < N; ++j) acc[j] = uint32_t(c.v[r][j]);
        for (int k = 0; k < K; ++k) {
            const int ark = a.v[r][k];
            for (int j = 0; j < N; ++j) acc[j] += uint32_t(ark * int(b.v[k][j]));
        }
        for (int j = 0; j < N; ++j) d.v[r][j] = TC(acc[j]);
    }
}

template <int M, int N, int K, class T>
inline void store_matrix_sync(T* p, const fragment<accumulator, M, N, K, T, void>& f, unsigned ldm,
                              layout_t layout) {
    for (int r = mexc_emu::lane(); r < M; r += mexc_emu::WARP)
        for (int c = 0; c < N; ++c)
            (layout == mem_col_major ? p[c * ldm + r] : p[r * ldm + c]) = f.v[r][c];
}
}  // namespace wmma
}  // namespace nvcuda

// ---- the launcher mexc.backends.cuda.emulator calls through ctypes --------------------------------------
namespace mexc_emu {

using Caller = void (*)(void*, void**);

// Every kernel parameter is a pointer (the plan passes buffers only), so a kernel of N
// parameters is called as a function of N void* arguments.
template <size_t... I>
void call_with(void* fn, void** a, std::index_sequence<I...>) {
    using F = void (*)(decltype((void)I, static_cast<void*>(nullptr))...);
    reinterpret_cast<F>(fn)(a[I]...);
}
template <size_t N>
void call_fixed(void* fn, void** a) {
    call_with(fn, a, std::make_index_sequence<N>{});
}
template <size_t... N>
constexpr std::array<Caller, sizeof...(N)> callers(std::index_sequence<N...>) {
    return {&call_fixed<N>...};
}
constexpr size_t MAX_ARGS = 48;
inline constexpr auto CALLERS = callers(std::make_index_sequence<MAX_ARGS + 1>{});

// Make linear thread t of the block the running one: threadIdx and the lane follow from it.
inline void enter_thread(int t) {
    const unsigned u = unsigned(t);
    g_thread = {u % g.block.x, u / g.block.x % g.block.y, u / (g.block.x * g.block.y)};
    g_linear = t;
}

[[noreturn]] inline void fiber_entry() {
    CALLERS[g.nargs](g.fn, g.args);
    g.current->wait = DONE;
    _longjmp(g.scheduler, 1);
}

inline void make_fibers() {
    if (g.stacks.size() < size_t(g.threads)) g.stacks.resize(g.threads);
    g.fibers.assign(g.threads, Fiber{});
    g.slots[0].assign(g.threads, 0);
    g.slots[1].assign(g.threads, 0);
    for (int t = 0; t < g.threads; ++t) {
        Fiber& f = g.fibers[t];
        f.linear = t;
        if (g.stacks[t].empty()) g.stacks[t].resize(STACK_BYTES);
        getcontext(&f.start);
        f.start.uc_stack.ss_sp = g.stacks[t].data();
        f.start.uc_stack.ss_size = STACK_BYTES;
        f.start.uc_link = nullptr;  // fiber_entry jumps back, never returns
        makecontext(&f.start, fiber_entry, 0);
    }
}

// Release the lanes of each warp that wait at a warp barrier (the others have exited or wait at
// a block barrier: they are not in the collective's active mask); failing that, the block
// barrier once every live thread has reached it. Returns false when nobody is left to run.
inline bool release() {
    bool any = false;
    for (auto& f : g.fibers)
        if (f.wait == AT_WARP_BARRIER) f.wait = RUNNABLE, any = true;
    if (any) return true;
    for (auto& f : g.fibers)
        if (f.wait == AT_BLOCK_BARRIER) f.wait = RUNNABLE, any = true;
    return any;
}

inline void run_block_fibers() {
    make_fibers();
    for (;;) {
        for (int i = 0; i < g.threads; ++i) {
            Fiber& f = g.fibers[g.reverse ? g.threads - 1 - i : i];
            if (f.wait != RUNNABLE) continue;
            g.current = &f;
            enter_thread(f.linear);
            if (_setjmp(g.scheduler) == 0) {
                if (f.started) _longjmp(f.at, 1);
                f.started = true;
                setcontext(&f.start);
            }
            if (g.error) return;
        }
        if (!release()) return;
    }
}

inline void run_block_plain() {
    g.current = nullptr;
    for (int i = 0; i < g.threads && !g.error; ++i) {
        enter_thread(g.reverse ? g.threads - 1 - i : i);
        CALLERS[g.nargs](g.fn, g.args);
    }
}

}  // namespace mexc_emu

extern "C" const char* mexc_emu_error() { return mexc_emu::g.error ? mexc_emu::g.error : ""; }

// Run kernel `fn` over grid x block; `fibers` when it has barriers or warp collectives;
// `reverse` runs blocks and threads last to first. Returns 0, or 1 with mexc_emu_error() saying
// why.
extern "C" int mexc_emu_launch(void* fn, int nargs, void** args, const int* grid, const int* block,
                               int fibers, int reverse) {
    using namespace mexc_emu;
    g.error = nullptr;
    if (nargs < 0 || size_t(nargs) > MAX_ARGS) {
        g.error = "kernel has more parameters than the emulator supports";
        return 1;
    }
    g.fn = fn, g.nargs = nargs, g.args = args;
    g.grid = {unsigned(grid[0]), unsigned(grid[1]), unsigned(grid[2])};
    g.block = {unsigned(block[0]), unsigned(block[1]), unsigned(block[2])};
    g.threads = block[0] * block[1] * block[2];
    g.reverse = reverse != 0;
    const long blocks = long(g.grid.x) * g.grid.y * g.grid.z;
    for (long i = 0; i < blocks; ++i) {
        long b = g.reverse ? blocks - 1 - i : i;
        g_block = {unsigned(b % g.grid.x), unsigned(b / g.grid.x % g.grid.y),
                   unsigned(b / (long(g.grid.x) * g.grid.y))};
        fibers ? run_block_fibers() : run_block_plain();
        if (g.error) return 1;
    }
    return 0;
}
