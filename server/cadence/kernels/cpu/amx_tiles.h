// AMX's tile instructions behind one interface, so the kernel that uses them (quant_amx.h)
// is written once and runs two ways: HardwareTiles issues the instructions, EmulatedTiles
// computes what the Intel SDM defines them to do on a register file in memory. Only the
// second can run on a CPU without AMX, which is how the kernel is tested there.
//
// Both structs have the same static functions; tile numbers are template parameters, as
// they are immediates in the instructions:
//   configure(cfg)          ldtilecfg: the shapes below; tile data zeroed
//   release()               tilerelease: back to the INIT state (data zeroed)
//   load<T>(base, stride)   tileloadd: rows(T) rows of colsb(T) bytes, stride bytes apart
//   store<T>(base, stride)  tilestored
//   zero<T>()               tilezero
//   dpbsud<C, A, B>()       tdpbsud: C[m][n] += sum over k, i of s8(A[m][4k+i]) * u8(B[k][4n+i])
//   dpbusd<C, A, B>()       tdpbusd: the same of u8(A) * s8(B)
//   dpbssd<C, A, B>()       tdpbssd: the same of s8(A) * s8(B)
//   dpbf16ps<C, A, B>()     tdpbf16ps: C[m][n] (fp32) += A[m][2k] * B[k][2n] (bf16 pairs), then
//                           += A[m][2k+1] * B[k][2n+1], k ascending
//   ok()                    false once an instruction the hardware refuses (#UD, #GP) ran
//                           since configure() (the emulation's record: the hardware faults)
// and request_permission(): whether this process may run the hardware's.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace cadence_amx {

// CPUID leaf 7, sub-leaf 0, EDX: the AMX features.
constexpr unsigned AMX_BF16 = 1u << 22, AMX_TILE = 1u << 24, AMX_INT8 = 1u << 25;

// Whether this process may run AMX-TILE and the `features` (AMX-INT8 by default): the CPU
// has them and Linux grants the tile data state. Since Linux 5.16 a process must ask
// (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) before its first tile instruction,
// which is otherwise killed by SIGILL; the grant covers all its threads and every AMX
// feature. Never faults: a CPU, kernel or hypervisor without AMX answers false.
inline bool request_permission(unsigned features = AMX_INT8) {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const unsigned needed = AMX_TILE | features;
    if ((edx & needed) != needed) return false;
#if defined(__linux__) && defined(SYS_arch_prctl)
    constexpr long GET_PERM = 0x1022, REQUEST_PERM = 0x1023, XTILEDATA = 18;
    if (syscall(SYS_arch_prctl, REQUEST_PERM, XTILEDATA) != 0) return false;
    unsigned long granted = 0;  // the features this process may use, as a bit mask
    if (syscall(SYS_arch_prctl, GET_PERM, &granted) != 0) return false;
    return (granted >> XTILEDATA) & 1u;
#else
    return false;
#endif
}

// LDTILECFG's 64-byte operand, palette 1 (8 tiles of at most 16 rows x 64 bytes): tiles
// 8..15's entries and the reserved bytes must stay zero.
struct alignas(64) TileConfig {
    uint8_t palette_id = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};

    void shape(int tile, int rows_, int colsb_) {
        rows[tile] = static_cast<uint8_t>(rows_);
        colsb[tile] = static_cast<uint16_t>(colsb_);
    }
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

constexpr int TILES = 8, MAX_ROWS = 16, MAX_COLSB = 64;

// The AMX code is compiled for these extensions function by function, so the library keeps
// its instruction set's flags and still loads (and runs everything else) on CPUs without
// AMX. Anything that inlines a HardwareTiles function needs the same attribute.
#define CADENCE_AMX_TARGET __attribute__((target("amx-tile,amx-int8")))
#define CADENCE_AMX_BF16_TARGET __attribute__((target("amx-tile,amx-bf16")))

// The instructions, in inline assembly rather than GCC's _tile_* macros: those paste their
// tile argument as text (`%%tmm"#dst"`), so a template parameter cannot be one, and their
// loads and ldtilecfg tell the compiler of no (or 8 bytes of) memory read, so a store just
// before them (the int4 panel's unpacking, the config) could legally be moved after or
// dropped. Here every tile load and store is a compiler memory barrier and ldtilecfg reads
// all 64 bytes. Dialect alternatives {AT&T|Intel} as in GCC's own headers.
struct HardwareTiles {
    CADENCE_AMX_TARGET static void configure(const TileConfig& cfg) {
        asm volatile("ldtilecfg %X0" ::"m"(cfg));
    }
    CADENCE_AMX_TARGET static void release() { _tile_release(); }
    template <int T>
    CADENCE_AMX_TARGET static void load(const void* base, int64_t stride) {
        asm volatile("{tileloadd (%0,%1,1), %%tmm%c2|tileloadd tmm%c2, [%0+%1*1]}" ::"r"(base),
                     "r"(stride), "i"(T)
                     : "memory");
    }
    template <int T>
    CADENCE_AMX_TARGET static void store(void* base, int64_t stride) {
        asm volatile("{tilestored %%tmm%c2, (%0,%1,1)|tilestored [%0+%1*1], tmm%c2}" ::"r"(base),
                     "r"(stride), "i"(T)
                     : "memory");
    }
    template <int T>
    CADENCE_AMX_TARGET static void zero() {
        asm volatile("{tilezero %%tmm%c0|tilezero tmm%c0}" ::"i"(T));
    }
    template <int C, int A, int B>
    CADENCE_AMX_TARGET static void dpbsud() {
        asm volatile("{tdpbsud %%tmm%c2, %%tmm%c1, %%tmm%c0|tdpbsud tmm%c0, tmm%c1, tmm%c2}" ::
                         "i"(C), "i"(A), "i"(B));
    }
    template <int C, int A, int B>
    CADENCE_AMX_TARGET static void dpbusd() {
        asm volatile("{tdpbusd %%tmm%c2, %%tmm%c1, %%tmm%c0|tdpbusd tmm%c0, tmm%c1, tmm%c2}" ::
                         "i"(C), "i"(A), "i"(B));
    }
    template <int C, int A, int B>
    CADENCE_AMX_TARGET static void dpbssd() {
        asm volatile("{tdpbssd %%tmm%c2, %%tmm%c1, %%tmm%c0|tdpbssd tmm%c0, tmm%c1, tmm%c2}" ::
                         "i"(C), "i"(A), "i"(B));
    }
    template <int C, int A, int B>
    CADENCE_AMX_BF16_TARGET static void dpbf16ps() {
        asm volatile("{tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0|tdpbf16ps tmm%c0, tmm%c1, tmm%c2}" ::
                         "i"(C), "i"(A), "i"(B));
    }
    static bool ok() { return true; }
};

// The SDM's definitions on a thread's own register file (tile state is per thread on the
// hardware too). Where the hardware faults, the emulation records it (ok() false) and does
// nothing, so a kernel bug shows as an error status here rather than only on an AMX CPU.
struct EmulatedTiles {
    struct State {
        uint8_t data[TILES][MAX_ROWS][MAX_COLSB];
        int rows[TILES], colsb[TILES];
        bool configured, fault;
    };
    static State& state() {
        static thread_local State s{};
        return s;
    }

    static void configure(const TileConfig& cfg) {
        State& s = state();
        std::memset(s.data, 0, sizeof s.data);
        s.configured = false;
        if (cfg.palette_id == 0) return;  // the INIT state, as release()
        bool valid = cfg.palette_id == 1 && cfg.start_row == 0;
        for (uint8_t r : cfg.reserved) valid = valid && r == 0;
        for (int t = TILES; t < 16; ++t) valid = valid && cfg.rows[t] == 0 && cfg.colsb[t] == 0;
        for (int t = 0; t < TILES; ++t) {
            s.rows[t] = cfg.rows[t];
            s.colsb[t] = cfg.colsb[t];
            // a tile is either unused (both zero) or within palette 1's 16 x 64 bytes
            valid = valid && (s.rows[t] == 0) == (s.colsb[t] == 0) && s.rows[t] <= MAX_ROWS &&
                    s.colsb[t] <= MAX_COLSB;
        }
        s.configured = valid;
        s.fault = !valid;  // #GP; a configuration starts a kernel's run afresh
    }
    static void release() {
        State& s = state();
        std::memset(s.data, 0, sizeof s.data);
        s.configured = false;
    }
    template <int T>
    static void load(const void* base, int64_t stride) {
        static_assert(0 <= T && T < TILES);
        State& s = state();
        if (!usable(s, T)) return;
        std::memset(s.data[T], 0, sizeof s.data[T]);  // columns and rows past the shape
        for (int r = 0; r < s.rows[T]; ++r)
            std::memcpy(s.data[T][r], static_cast<const uint8_t*>(base) + r * stride, s.colsb[T]);
    }
    template <int T>
    static void store(void* base, int64_t stride) {
        static_assert(0 <= T && T < TILES);
        State& s = state();
        if (!usable(s, T)) return;
        for (int r = 0; r < s.rows[T]; ++r)
            std::memcpy(static_cast<uint8_t*>(base) + r * stride, s.data[T][r], s.colsb[T]);
    }
    template <int T>
    static void zero() {
        static_assert(0 <= T && T < TILES);
        State& s = state();
        if (usable(s, T)) std::memset(s.data[T], 0, sizeof s.data[T]);
    }
    template <int C, int A, int B>
    static void dpbsud() {
        int8_dots<C, A, B, true, false>();
    }
    template <int C, int A, int B>
    static void dpbusd() {
        int8_dots<C, A, B, false, true>();
    }
    template <int C, int A, int B>
    static void dpbssd() {
        int8_dots<C, A, B, true, true>();
    }
    template <int C, int A, int B>
    static void dpbf16ps() {
        each_output<C, A, B>([](const uint8_t* a, const uint8_t* const* b, int j, int k,
                                uint8_t* c) {
            float acc;
            std::memcpy(&acc, c, 4);
            for (int kk = 0; kk < k; ++kk)
                for (int i = 0; i < 2; ++i)  // a bf16 product is exact in fp32
                    acc = flush(acc + bf16(a + 4 * kk + 2 * i) * bf16(b[kk] + 4 * j + 2 * i));
            std::memcpy(c, &acc, 4);
        });
    }
    static bool ok() { return !state().fault; }

   private:
    // tdpb[su][su]d: A's and B's bytes signed or unsigned as the instruction's letters say
    template <int C, int A, int B, bool A_SIGNED, bool B_SIGNED>
    static void int8_dots() {
        each_output<C, A, B>([](const uint8_t* a, const uint8_t* const* b, int j, int k,
                                uint8_t* c) {
            uint32_t acc;  // int32 arithmetic wraps: add as uint32
            std::memcpy(&acc, c, 4);
            for (int kk = 0; kk < k; ++kk) {
                uint32_t dot = 0;
                for (int i = 0; i < 4; ++i)
                    dot += static_cast<uint32_t>(byte<A_SIGNED>(a[4 * kk + i]) *
                                                 byte<B_SIGNED>(b[kk][4 * j + i]));
                acc += dot;
            }
            std::memcpy(c, &acc, 4);
        });
    }
    template <bool SIGNED>
    static int32_t byte(uint8_t v) {
        return SIGNED ? static_cast<int32_t>(static_cast<int8_t>(v)) : static_cast<int32_t>(v);
    }
    // A dot product instruction's frame: the tiles checked (#UD otherwise), then
    // dot(A's row m, B's rows, column j, A's dwords, C[m]'s dword j) for every output, the
    // rest of C's rows and columns zeroed as the hardware zeroes them.
    template <int C, int A, int B, class Dot>
    static void each_output(Dot dot) {
        static_assert(0 <= C && C < TILES && 0 <= A && A < TILES && 0 <= B && B < TILES);
        static_assert(C != A && C != B && A != B, "#UD: the three tiles must differ");
        State& s = state();
        if (!chained(s, C, A, B)) return;
        const int m_rows = s.rows[C], n = s.colsb[C] / 4, k = s.colsb[A] / 4;
        const uint8_t* b[MAX_ROWS];
        for (int kk = 0; kk < k; ++kk) b[kk] = s.data[B][kk];
        for (int m = 0; m < m_rows; ++m) {
            uint8_t* c = s.data[C][m];
            for (int j = 0; j < n; ++j) dot(s.data[A][m], b, j, k, c + 4 * j);
            std::memset(c + 4 * n, 0, MAX_COLSB - 4 * n);  // the row past colsb is zeroed
        }
        for (int m = m_rows; m < MAX_ROWS; ++m) std::memset(s.data[C][m], 0, MAX_COLSB);
    }
    // tdpbf16ps reads denormal bf16 inputs as zero and flushes denormal results to zero
    static float flush(float v) { return std::fabs(v) < 1.17549435e-38f ? 0.0f * v : v; }
    static float bf16(const uint8_t* p) {
        uint16_t bits;
        std::memcpy(&bits, p, 2);
        const uint32_t wide = static_cast<uint32_t>(bits) << 16;
        float v;
        std::memcpy(&v, &wide, 4);
        return flush(v);
    }
    // A dot product's tiles: each usable, and (#UD otherwise) their shapes chain: C is A's
    // rows x B's columns, A's dwords B's rows.
    static bool chained(State& s, int c, int a, int b) {
        if (!usable(s, c) || !usable(s, a) || !usable(s, b)) return false;
        if (s.colsb[c] % 4 || s.colsb[a] % 4 || s.rows[a] != s.rows[c] ||
            s.colsb[b] != s.colsb[c] || s.rows[b] != s.colsb[a] / 4) {
            s.fault = true;
            return false;
        }
        return true;
    }
    static bool usable(State& s, int t) {  // #UD: no configuration, or an unused tile
        const bool on = s.configured && s.rows[t] != 0;
        s.fault = s.fault || !on;
        return on;
    }
};

}  // namespace cadence_amx
