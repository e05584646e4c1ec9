// sim_runtime.cpp: the CPU simulator's scheduler. Every CUDA thread of a block is a fiber.
//
// A launch runs the blocks one after another, by default in blockIdx order (x fastest);
// Schedule::block_order reverses or shuffles that order (a seeded permutation). Within a
// block the scheduler resumes READY fibers in FIFO order, or in a seeded random order
// (Schedule::random_fibers); a fiber runs until it waits (a barrier or a warp collective),
// yields (a failed atomicCAS, __nanosleep) or returns. When no fiber is READY the block is
// "quiescent": either every live thread waits at the same __syncthreads() and all are
// released, or nothing can ever move again and the launch stops with a deadlock report. A
// warp collective completes as soon as the last lane of its mask arrives. Nothing depends on
// timing, so every run of a kernel with the same schedule (and seeds) is the same.
//
// Errors never kill the process: a fault inside a fiber (bad shuffle, __trap, assert, or a
// signal such as SIGSEGV on the stack guard page) records a message and returns to the
// scheduler, which abandons the launch. launch() returns the error kind and the message.
#include <assert.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/time.h>

#include <vector>

#include "cuda_sim.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define MINIKV_ASAN 1
#endif
#if !defined(__x86_64__) || defined(MINIKV_SIM_UCONTEXT)
#include <ucontext.h>
#define MINIKV_USE_UCONTEXT 1  // portable fallback, about 7x slower (a system call per switch)
#endif

extern char __start_minikv_shared[] __attribute__((weak, visibility("hidden")));
extern char __stop_minikv_shared[] __attribute__((weak, visibility("hidden")));

namespace minikv_sim {

ThreadRegs* g_regs;
uint3 g_block_idx;
dim3 g_block_dim, g_grid_dim;

namespace {

enum State : unsigned char { READY, RUNNING, AT_BARRIER, AT_WARP, EXITED };
enum ErrorKind { OK = 0, FAULT = 1, DEADLOCK = 2, BAD_LAUNCH = 3 };

const size_t kGuardBytes = 64 * 1024;  // PROT_NONE below every stack; -fstack-clash-protection probes it
const unsigned long kMaxSpins = 1ul << 20;  // yields in a row without progress = a livelock
const char* const kTimeoutMessage =
    "the launch exceeded its CPU time limit (MINIKV_SIM_TIMEOUT seconds, default 60): a thread spins on "
    "a value that only another thread would change (the simulator cannot preempt it), or the launch is "
    "too large for the simulator";

#ifdef MINIKV_USE_UCONTEXT
struct Context { ucontext_t uc; };
#else
struct Context { void* sp; };  // the rest lies on the fiber's own stack (switch_x86_64.S)
#endif

struct Fiber {
    ThreadRegs regs;
    State state;
    char* stack_lo;  // usable stack [stack_lo, stack_lo + stack_size); the guard lies below
    size_t stack_size;
    Context ctx;  // saved registers while switched out
#ifdef MINIKV_ASAN
    void* fake_stack;
#endif
    // What the fiber waits on (AT_BARRIER, AT_WARP), and what the collective returns to it.
    Site site;
    int op;
    unsigned mask;
    uint64_t value;
    int arg, width;
    uint64_t result;
};

// Lanes of one warp that wait in a collective with the same mask. Lanes with another mask form
// another group (divergent code may split a warp into several).
struct WarpGroup {
    unsigned mask;
    unsigned arrived;  // lanes of the mask that wait so far
};
struct WarpState {
    WarpGroup groups[32];
    int n_groups;
};

std::vector<Fiber> g_fibers;   // one per thread of the block
std::vector<WarpState> g_warps;
std::vector<char*> g_stacks;   // mmap'ed stacks, reused by every block and launch
size_t g_stack_size;
std::vector<int> g_ring;       // READY fibers, FIFO
unsigned g_ring_head, g_ring_count;
Fiber* g_running;
unsigned g_n_threads, g_n_exited;
unsigned long g_spins;
void (*g_entry)(void**);
void** g_args;
bool g_random_fibers;  // pop a random READY fiber instead of the oldest
uint64_t g_rng;        // splitmix64 state of the fiber schedule

uint64_t next_random(uint64_t* state) {  // splitmix64: small, fast, good enough for schedules
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

Context g_sched_ctx;  // the scheduler, on the launching thread's own stack
#ifdef MINIKV_ASAN
void* g_sched_fake_stack;
const void* g_main_stack_bottom;  // that stack, for ASan's fiber annotations
size_t g_main_stack_size;
bool g_stacks_dirty;  // an abandoned fiber left ASan poison on its stack
#endif

int g_error;
char g_msg[4096];
sigjmp_buf g_escape;                  // back to launch() from a signal handler
volatile sig_atomic_t g_in_fiber;     // a fiber (not the scheduler) is running
volatile sig_atomic_t g_timeout_hit;  // the watchdog fired while the scheduler ran
pthread_t g_launch_thread;

// ---- messages ---------------------------------------------------------------------------

void vappend(const char* fmt, va_list ap) {
    const size_t used = strlen(g_msg);
    vsnprintf(g_msg + used, sizeof g_msg - used, fmt, ap);
}
void append(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vappend(fmt, ap);
    va_end(ap);
}
void set_error(int kind, const char* fmt, ...) {
    g_error = kind;
    snprintf(g_msg, sizeof g_msg, "block (%u,%u,%u): ", g_block_idx.x, g_block_idx.y, g_block_idx.z);
    va_list ap;
    va_start(ap, fmt);
    vappend(fmt, ap);
    va_end(ap);
}
const char* thread_str(const Fiber& f) {
    static char buf[64];
    snprintf(buf, sizeof buf, "thread (%u,%u,%u)", f.regs.thread_idx.x, f.regs.thread_idx.y,
             f.regs.thread_idx.z);
    return buf;
}
// Appends "0-15, 17" for the fibers [first, first+count) that satisfy pred; returns how many.
template <class Pred>
int append_ids(unsigned first, unsigned count, unsigned offset, Pred pred) {
    int n = 0;
    for (unsigned i = first; i < first + count; ++i) {
        if (!pred(g_fibers[i])) continue;
        unsigned j = i;
        while (j + 1 < first + count && pred(g_fibers[j + 1])) ++j;
        append(n ? ", %u" : "%u", i - offset);
        if (j > i) append("-%u", j - offset);
        n += j - i + 1;
        i = j;
    }
    return n;
}
const char* op_name(int op) {
    static const char* names[] = {"__syncwarp", "__shfl_sync", "__shfl_up_sync", "__shfl_down_sync",
                                  "__shfl_xor_sync", "__ballot_sync", "__any_sync", "__all_sync",
                                  "__match_any_sync", "__reduce_add_sync", "__reduce_min_sync",
                                  "__reduce_max_sync", "__reduce_min_sync", "__reduce_max_sync",
                                  "__reduce_and_sync", "__reduce_or_sync", "__reduce_xor_sync"};
    return op >= 0 && op < (int)(sizeof names / sizeof *names) ? names[op] : "?";
}
const char* barrier_name(int op) {
    static const char* names[] = {"__syncthreads", "__syncthreads_count", "__syncthreads_and",
                                  "__syncthreads_or"};
    return names[op];
}

// ---- fibers: stacks and context switches --------------------------------------------------

char* map_stack(size_t size) {
    char* p = (char*)mmap(nullptr, kGuardBytes + size, PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    mprotect(p, kGuardBytes, PROT_NONE);  // the guard page(s): overflowing into it is a SIGSEGV
    return p + kGuardBytes;
}

void fiber_main(Fiber* f);

#ifdef MINIKV_USE_UCONTEXT
void ucontext_entry() { fiber_main(g_running); }
void prepare(Fiber* f) {
    getcontext(&f->ctx.uc);
    f->ctx.uc.uc_stack.ss_sp = f->stack_lo;
    f->ctx.uc.uc_stack.ss_size = f->stack_size;
    f->ctx.uc.uc_link = nullptr;
    makecontext(&f->ctx.uc, ucontext_entry, 0);
}
void context_switch(Context* save, Context* load) { swapcontext(&save->uc, &load->uc); }
#else
extern "C" void minikv_switch(void** save_sp, void* load_sp);
extern "C" void minikv_fiber_start();
// Builds the frame that minikv_switch pops on the first switch to f (see switch_x86_64.S).
void prepare(Fiber* f) {
    const uintptr_t top = (uintptr_t)(f->stack_lo + f->stack_size) & ~(uintptr_t)15;
    uint64_t* frame = (uint64_t*)(top - 56);
    frame[0] = 0;                        // r15
    frame[1] = 0;                        // r14
    frame[2] = (uint64_t)&fiber_main;    // r13: the function minikv_fiber_start calls
    frame[3] = (uint64_t)f;              // r12: its argument
    frame[4] = 0;                        // rbx
    frame[5] = 0;                        // rbp
    frame[6] = (uint64_t)&minikv_fiber_start;
    f->ctx.sp = frame;
}
void context_switch(Context* save, Context* load) { minikv_switch(&save->sp, load->sp); }
#endif

void make_running(Fiber* f) {
    g_running = f;
    g_regs = &f->regs;
    f->state = RUNNING;
}

Fiber* pop_ready() {
    if (g_random_fibers && g_ring_count > 1) {  // swap a random READY fiber to the head
        const unsigned pick = (g_ring_head + (unsigned)(next_random(&g_rng) % g_ring_count)) % g_n_threads;
        const int t = g_ring[pick];
        g_ring[pick] = g_ring[g_ring_head];
        g_ring[g_ring_head] = t;
    }
    Fiber* f = &g_fibers[g_ring[g_ring_head]];
    g_ring_head = (g_ring_head + 1) % g_n_threads;
    --g_ring_count;
    return f;
}

// Scheduler -> fiber f. Returns when no fiber is READY any more (or a fault stopped the block).
void resume(Fiber* f) {
    make_running(f);
    g_in_fiber = 1;
#ifdef MINIKV_ASAN
    __sanitizer_start_switch_fiber(&g_sched_fake_stack, f->stack_lo, f->stack_size);
#endif
    context_switch(&g_sched_ctx, &f->ctx);
#ifdef MINIKV_ASAN
    __sanitizer_finish_switch_fiber(g_sched_fake_stack, nullptr, nullptr);
#endif
    g_in_fiber = 0;
    g_running = nullptr;
}

// The running fiber stops (it waits, yields, exits or faulted): switch straight to the next
// READY fiber, or back to the scheduler when there is none. With finished, it never resumes.
void suspend(bool finished) {
    Fiber* f = g_running;
    Fiber* next = g_ring_count && !g_error ? pop_ready() : nullptr;
    if (next == f) {  // it was its own successor (a yield, a random pick): no switch
        make_running(f);
        return;
    }
#ifdef MINIKV_ASAN
    __sanitizer_start_switch_fiber(finished ? nullptr : &f->fake_stack, next ? next->stack_lo : g_main_stack_bottom,
                                   next ? next->stack_size : g_main_stack_size);
#else
    (void)finished;
#endif
    if (next) {
        make_running(next);
        context_switch(&f->ctx, &next->ctx);
    } else {
        context_switch(&f->ctx, &g_sched_ctx);
    }
#ifdef MINIKV_ASAN
    __sanitizer_finish_switch_fiber(f->fake_stack, nullptr, nullptr);
#endif
}

void fiber_main(Fiber* f) {
#ifdef MINIKV_ASAN
    __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
    g_entry(g_args);
    f->state = EXITED;
    ++g_n_exited;
    g_spins = 0;
    suspend(true);
    __builtin_unreachable();
}

// A fault inside a fiber: record it and leave the fiber for good.
[[noreturn]] void fail(int kind, const char* fmt, ...) {
    Fiber* f = g_running;
    g_error = kind;
    snprintf(g_msg, sizeof g_msg, "block (%u,%u,%u), %s: ", g_block_idx.x, g_block_idx.y,
             g_block_idx.z, thread_str(*f));
    va_list ap;
    va_start(ap, fmt);
    vappend(fmt, ap);
    va_end(ap);
#ifdef MINIKV_ASAN
    g_stacks_dirty = true;
#endif
    suspend(true);
    __builtin_unreachable();
}

void make_ready(Fiber* f) {
    f->state = READY;
    g_ring[(g_ring_head + g_ring_count++) % g_n_threads] = (int)(f - g_fibers.data());
}

// ---- warp collectives -----------------------------------------------------------------------

bool is_shuffle(int op) { return op >= SHFL_IDX && op <= SHFL_XOR; }

// All lanes of `members` wait in the same collective: compute every lane's result.
void complete_collective(Fiber* lanes, unsigned members) {
    const int op = lanes[__builtin_ctz(members)].op;
    unsigned ballot = 0;
    for (unsigned l = 0; l < 32; ++l)
        if ((members >> l & 1u) && lanes[l].value != 0) ballot |= 1u << l;
    uint64_t acc = 0;
    bool first = true;
    for (unsigned l = 0; l < 32; ++l) {
        if (!(members >> l & 1u)) continue;
        const uint64_t v = lanes[l].value;
        switch (op) {
            case REDUCE_ADD: acc = (uint32_t)(acc + v); break;
            case REDUCE_AND: acc = first ? v : (acc & v); break;
            case REDUCE_OR: acc |= v; break;
            case REDUCE_XOR: acc ^= v; break;
            case REDUCE_MIN_I: acc = first || (int64_t)v < (int64_t)acc ? v : acc; break;
            case REDUCE_MAX_I: acc = first || (int64_t)v > (int64_t)acc ? v : acc; break;
            case REDUCE_MIN_U: acc = first || v < acc ? v : acc; break;
            case REDUCE_MAX_U: acc = first || v > acc ? v : acc; break;
            default: break;
        }
        first = false;
    }
    for (unsigned l = 0; l < 32; ++l) {
        if (!(members >> l & 1u)) continue;
        Fiber& f = lanes[l];
        switch (op) {
            case WARP_SYNC: f.result = 0; break;
            case VOTE_BALLOT: f.result = ballot; break;
            case VOTE_ANY: f.result = ballot != 0; break;
            case VOTE_ALL: f.result = ballot == members; break;
            case MATCH_ANY: {
                unsigned same = 0;
                for (unsigned m = 0; m < 32; ++m)
                    if ((members >> m & 1u) && lanes[m].value == f.value) same |= 1u << m;
                f.result = same;
                break;
            }
            case SHFL_IDX: case SHFL_UP: case SHFL_DOWN: case SHFL_XOR: {
                // PTX shfl.sync: lanes form segments of `width`; an index outside the allowed
                // range returns the lane's own value. Reading a lane outside the mask is
                // undefined on a GPU: the simulator returns all-ones bits (NaN, -1) so it shows.
                const int w = f.width, seg_lo = (int)l & ~(w - 1), seg_hi = seg_lo + w - 1;
                int src = (int)l;
                bool in_range = true;
                if (op == SHFL_IDX) src = seg_lo | (f.arg & (w - 1));
                else if (op == SHFL_UP) { src = (int)l - f.arg; in_range = src >= seg_lo; }
                else if (op == SHFL_DOWN) { src = (int)l + f.arg; in_range = src <= seg_hi; }
                else { src = (int)l ^ f.arg; in_range = src <= seg_hi; }
                if (!in_range) f.result = f.value;
                else if (src >= 0 && src < 32 && (members >> src & 1u)) f.result = lanes[src].value;
                else f.result = ~0ull;
                break;
            }
            default: f.result = acc; break;
        }
    }
}

}  // namespace

uint64_t warp_collective(WarpOp op, unsigned mask, uint64_t value, int arg, int width, Site site) {
    Fiber* me = g_running;
    const unsigned lane = me->regs.lane;
    if (!(mask >> lane & 1u))
        fail(FAULT, "%s at %s:%d: mask 0x%08x does not include the calling lane %u (CUDA: undefined)",
             op_name(op), site.file, site.line, mask, lane);
    if (is_shuffle(op) && (width < 1 || width > 32 || (width & (width - 1))))
        fail(FAULT, "%s at %s:%d: width %d must be a power of two from 1 to 32", op_name(op), site.file,
             site.line, width);
    me->state = AT_WARP;
    me->op = op;
    me->mask = mask;
    me->value = value;
    me->arg = arg;
    me->width = width;
    me->site = site;
    // Lanes of a last, partial warp do not exist; the mask may name them (0xffffffff).
    const unsigned base = me->regs.warp * 32u, n_lanes = g_n_threads - base < 32 ? g_n_threads - base : 32;
    const unsigned members = mask & (n_lanes == 32 ? ~0u : (1u << n_lanes) - 1u);
    Fiber* lanes = &g_fibers[base];
    // The collective completes when every lane named in the mask waits with the same mask.
    WarpState& ws = g_warps[me->regs.warp];
    int g = 0;
    while (g < ws.n_groups && ws.groups[g].mask != mask) ++g;
    if (g == ws.n_groups) ws.groups[ws.n_groups++] = WarpGroup{mask, 0u};
    ws.groups[g].arrived |= 1u << lane;
    g_spins = 0;
    if ((ws.groups[g].arrived & members) != members) {
        suspend(false);  // a later lane completes the group and wakes us
        return me->result;
    }
    ws.groups[g] = ws.groups[--ws.n_groups];  // the group is complete: forget it
    for (unsigned l = 0; l < 32; ++l) {
        const Fiber& o = lanes[l];
        if ((members >> l & 1u) && (o.op != op || (is_shuffle(op) && o.width != width)))
            fail(FAULT, "lanes of warp %u meet in different collectives with mask 0x%08x: lane %u in %s "
                 "(width %d) at %s:%d, lane %u in %s (width %d) at %s:%d",
                 me->regs.warp, mask, lane, op_name(op), width, site.file, site.line, l, op_name(o.op),
                 o.width, o.site.file, o.site.line);
    }
    complete_collective(lanes, members);
    for (unsigned l = 0; l < 32; ++l)
        if ((members >> l & 1u) && &lanes[l] != me) make_ready(&lanes[l]);
    if (g_random_fibers) {  // a switch point too: any lane of the group may go on first
        make_ready(me);
        suspend(false);
    }
    me->state = RUNNING;
    return me->result;
}

int barrier(BarrierOp op, int predicate, Site site) {
    Fiber* me = g_running;
    me->state = AT_BARRIER;
    me->op = op;
    me->value = (uint64_t)predicate;
    me->site = site;
    g_spins = 0;
    suspend(false);  // the scheduler releases the barrier once every thread waits here
    return (int)me->result;
}

unsigned active_mask() {
    const unsigned base = g_running->regs.warp * 32u;
    unsigned m = 0;
    for (unsigned l = 0; l < 32 && base + l < g_n_threads; ++l)
        if (g_fibers[base + l].state != EXITED) m |= 1u << l;
    return m;
}

void yield() {
    if (++g_spins > kMaxSpins)
        fail(DEADLOCK, "threads spin (atomicCAS fails again and again, or __nanosleep) while no other thread "
             "can move: a spin lock whose holder waits at a barrier?");
    make_ready(g_running);
    suspend(false);
}

void trap(const char* what, Site site) { fail(FAULT, "%s at %s:%d", what, site.file, site.line); }

namespace {

// ---- quiescence: release a barrier, or report why nothing can move ---------------------------

bool same_site(const Fiber& a, const Fiber& b) {
    return a.op == b.op && a.site.line == b.site.line &&
           (a.site.file == b.site.file || strcmp(a.site.file, b.site.file) == 0);
}

void report_stuck_warp(const Fiber& w) {
    const unsigned base = w.regs.warp * 32u, end = base + 32 < g_n_threads ? base + 32 : g_n_threads;
    bool exited = false;
    for (unsigned i = base; i < end; ++i)
        if ((w.mask >> (i - base) & 1u) && g_fibers[i].state == EXITED) exited = true;
    set_error(exited ? FAULT : DEADLOCK, "%s with mask 0x%08x in warp %u at %s:%d waits forever. Lanes ",
              op_name(w.op), w.mask, w.regs.warp, w.site.file, w.site.line);
    append_ids(base, end - base, base, [&](const Fiber& f) { return f.state == AT_WARP && f.mask == w.mask; });
    append(" wait there; lanes ");
    auto missing = [&](const Fiber& f) {
        return (w.mask >> f.regs.lane & 1u) && !(f.state == AT_WARP && f.mask == w.mask);
    };
    append_ids(base, end - base, base, missing);
    append(" of the mask never arrive (");
    const char* sep = "";
    if (exited) {
        append("exited: lanes ");
        append_ids(base, end - base, base, [&](const Fiber& f) { return missing(f) && f.state == EXITED; });
        sep = "; ";
    }
    for (unsigned i = base; i < end; ++i) {  // the first lane that waits somewhere else
        const Fiber& f = g_fibers[i];
        if (!missing(f) || f.state == EXITED) continue;
        if (f.state == AT_BARRIER)
            append("%slane %u waits at %s() at %s:%d", sep, i - base, barrier_name(f.op), f.site.file, f.site.line);
        else
            append("%slane %u waits in %s with mask 0x%08x at %s:%d", sep, i - base, op_name(f.op), f.mask,
                   f.site.file, f.site.line);
        break;
    }
    append(").");
    append(exited ? " A shuffle or vote must not name lanes that exited."
                  : " Every lane named in the mask must reach the same collective.");
}

void settle() {
    const Fiber* waiter = nullptr;
    for (const Fiber& f : g_fibers) {
        if (&f - g_fibers.data() >= (long)g_n_threads) break;
        if (f.state == AT_WARP) { report_stuck_warp(f); return; }
        if (f.state == AT_BARRIER && !waiter) waiter = &f;
    }
    // Every live thread waits at a barrier: it must be the same one, reached by all.
    const Fiber& w = *waiter;
    if (g_n_exited > 0) {
        set_error(DEADLOCK, "%s() at %s:%d is never reached by threads ", barrier_name(w.op), w.site.file,
                  w.site.line);
        append_ids(0, g_n_threads, 0, [](const Fiber& f) { return f.state == EXITED; });
        append(" (linear ids), which exited; threads ");
        append_ids(0, g_n_threads, 0, [](const Fiber& f) { return f.state == AT_BARRIER; });
        append(" wait there forever. Every thread of the block must reach each __syncthreads() "
               "(an early return before a barrier is the usual cause).");
        return;
    }
    for (unsigned i = 0; i < g_n_threads; ++i) {
        const Fiber& f = g_fibers[i];
        if (!same_site(f, w)) {
            set_error(DEADLOCK, "threads wait at different barriers: threads ");
            append_ids(0, g_n_threads, 0, [&](const Fiber& o) { return same_site(o, w); });
            append(" at %s() %s:%d, threads ", barrier_name(w.op), w.site.file, w.site.line);
            append_ids(0, g_n_threads, 0, [&](const Fiber& o) { return same_site(o, f); });
            append(" at %s() %s:%d (linear ids). A __syncthreads() inside a branch that not all threads "
                   "take deadlocks on a GPU.", barrier_name(f.op), f.site.file, f.site.line);
            return;
        }
    }
    uint64_t count = 0;
    for (unsigned i = 0; i < g_n_threads; ++i) count += g_fibers[i].value;
    const uint64_t r = w.op == BAR_COUNT ? count : w.op == BAR_AND ? count == g_n_threads
                     : w.op == BAR_OR ? count != 0 : 0;
    for (unsigned i = 0; i < g_n_threads; ++i) {
        g_fibers[i].result = r;
        make_ready(&g_fibers[i]);
    }
}

void run_block() {
    const dim3 b = g_block_dim;
    g_n_exited = 0;
    g_ring_head = g_ring_count = 0;
    g_spins = 0;
    for (WarpState& w : g_warps) w.n_groups = 0;
    for (unsigned i = 0; i < g_n_threads; ++i) {
        Fiber& f = g_fibers[i];
        f.regs.thread_idx = uint3{i % b.x, (i / b.x) % b.y, i / (b.x * b.y)};
        f.regs.linear = i;
        f.regs.lane = i % 32;
        f.regs.warp = i / 32;
        f.value = 0;
        prepare(&f);
        make_ready(&f);
    }
    for (;;) {
        if (g_ring_count) resume(pop_ready());  // the fibers hand over to each other until none is READY
        if (g_error) return;
        if (g_timeout_hit) {  // the watchdog fired while the scheduler ran
            set_error(DEADLOCK, "%s", kTimeoutMessage);
            return;
        }
        if (g_n_exited == g_n_threads) return;
        settle();
        if (g_error) return;
    }
}

// ---- signals: faults inside a fiber, and the watchdog ---------------------------------------

const int kSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGVTALRM};
const int kNumSignals = sizeof kSignals / sizeof *kSignals;
struct sigaction g_old_actions[kNumSignals];
bool g_installed[kNumSignals];
stack_t g_old_altstack;
struct itimerval g_old_timer;

void restore_signals() {
    for (int i = 0; i < kNumSignals; ++i)
        if (g_installed[i]) sigaction(kSignals[i], &g_old_actions[i], nullptr), g_installed[i] = false;
}

void on_signal(int sig, siginfo_t* info, void*) {
    if (!pthread_equal(pthread_self(), g_launch_thread)) {
        if (sig == SIGVTALRM) pthread_kill(g_launch_thread, SIGVTALRM);  // a process-wide timer
        else restore_signals();  // not ours: the previous handler sees the signal again
        return;
    }
    if (!g_in_fiber) {
        if (sig == SIGVTALRM) { g_timeout_hit = 1; return; }
        restore_signals();  // a bug in the scheduler itself: let it crash normally
        return;
    }
    const Fiber& f = *g_running;
    g_error = FAULT;
    snprintf(g_msg, sizeof g_msg, "block (%u,%u,%u), %s: ", g_block_idx.x, g_block_idx.y, g_block_idx.z,
             thread_str(f));
    const char* addr = sig == SIGSEGV || sig == SIGBUS ? (const char*)info->si_addr : nullptr;
    if (addr && addr < f.stack_lo && addr >= f.stack_lo - kGuardBytes)
        append("stack overflow (deep or unbounded recursion?): each thread has a %zu KiB stack "
               "(set MINIKV_SIM_STACK_KB to change it)", f.stack_size / 1024);
    else if (sig == SIGSEGV || sig == SIGBUS)
        append("invalid memory access at address %p (an out-of-bounds index?)", (const void*)addr);
    else if (sig == SIGFPE) append("arithmetic fault (integer division by zero?)");
    else if (sig == SIGILL) append("illegal instruction (__builtin_trap(), or a corrupted stack)");
    else {
        g_error = DEADLOCK;
        append("%s", kTimeoutMessage);
    }
#ifdef MINIKV_ASAN
    g_stacks_dirty = true;
#endif
    siglongjmp(g_escape, 1);
}

void install_signals() {
    static char* altstack = nullptr;
    const size_t alt_size = 256 * 1024;
    if (!altstack)
        altstack = (char*)mmap(nullptr, alt_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    stack_t ss = {};
    ss.ss_sp = altstack;
    ss.ss_size = alt_size;
    sigaltstack(&ss, &g_old_altstack);
    struct sigaction sa = {};
    sa.sa_sigaction = on_signal;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < kNumSignals; ++i) g_installed[i] = sigaction(kSignals[i], &sa, &g_old_actions[i]) == 0;
    const char* env = getenv("MINIKV_SIM_TIMEOUT");
    const double timeout_s = env ? atof(env) : 60.0;
    struct itimerval t = {};
    t.it_value.tv_sec = (time_t)timeout_s;
    t.it_value.tv_usec = (suseconds_t)((timeout_s - (double)(time_t)timeout_s) * 1e6);
    setitimer(ITIMER_VIRTUAL, &t, &g_old_timer);  // 0 disarms: no watchdog
}

void uninstall_signals() {
    setitimer(ITIMER_VIRTUAL, &g_old_timer, nullptr);
    restore_signals();
    sigaltstack(&g_old_altstack, nullptr);
}

// Fibers and stacks for n threads; the stack size comes from MINIKV_SIM_STACK_KB.
bool ensure_fibers(unsigned n) {
    const char* env = getenv("MINIKV_SIM_STACK_KB");
#ifdef MINIKV_ASAN
    size_t size = (env ? (size_t)atol(env) : 1024) * 1024;  // ASan frames carry redzones
#else
    size_t size = (env ? (size_t)atol(env) : 256) * 1024;
#endif
    size = (size + 4095) & ~(size_t)4095;
    if (size < 16 * 1024) size = 16 * 1024;
    if (size != g_stack_size) {  // a new size: drop the old stacks
        for (char* s : g_stacks) munmap(s - kGuardBytes, kGuardBytes + g_stack_size);
        g_stacks.clear();
        g_stack_size = size;
    }
    while (g_stacks.size() < n) {
        char* s = map_stack(size);
        if (!s) return false;
        g_stacks.push_back(s);
    }
    if (g_fibers.size() < n) g_fibers.resize(n);
    if (g_ring.size() < n) g_ring.resize(n);
    if (g_warps.size() < (n + 31) / 32) g_warps.resize((n + 31) / 32);
    for (unsigned i = 0; i < n; ++i) {
        g_fibers[i].stack_lo = g_stacks[i];
        g_fibers[i].stack_size = size;
#ifdef MINIKV_ASAN
        if (g_stacks_dirty) ASAN_UNPOISON_MEMORY_REGION(g_stacks[i], size);
#endif
    }
#ifdef MINIKV_ASAN
    g_stacks_dirty = false;
#endif
    return true;
}

// The order in which a launch runs its blocks: block(i) is the i-th block to run.
struct BlockOrder {
    uint64_t total, gx, gy;
    int mode;                    // Schedule::block_order
    std::vector<uint32_t> perm;  // random order of up to kMaxPermuted blocks
    uint64_t mul = 1, add = 0;   // random order of larger grids: i -> (mul * i + add) mod total
    static const uint64_t kMaxPermuted = 1u << 22;

    BlockOrder(const unsigned grid[3], const Schedule& s)
        : total((uint64_t)grid[0] * grid[1] * grid[2]), gx(grid[0]), gy(grid[1]), mode(s.block_order) {
        if (mode != 2) return;
        uint64_t state = s.block_seed;
        if (total <= kMaxPermuted) {  // Fisher-Yates
            perm.resize(total);
            for (uint64_t i = 0; i < total; ++i) perm[i] = (uint32_t)i;
            for (uint64_t i = total; i > 1; --i) {
                const uint64_t j = next_random(&state) % i;
                const uint32_t t = perm[i - 1];
                perm[i - 1] = perm[j];
                perm[j] = t;
            }
        } else {  // an affine bijection: mul coprime with total
            auto gcd = [](uint64_t a, uint64_t b) { while (b) { const uint64_t t = a % b; a = b; b = t; } return a; };
            do mul = next_random(&state) % total; while (mul == 0 || gcd(mul, total) != 1);
            add = next_random(&state) % total;
        }
    }
    uint3 block(uint64_t i) const {
        uint64_t id = i;
        if (mode == 1) id = total - 1 - i;
        else if (mode == 2) id = perm.empty() ? (uint64_t)(((unsigned __int128)mul * i + add) % total) : perm[i];
        return uint3{(unsigned)(id % gx), (unsigned)(id / gx % gy), (unsigned)(id / (gx * gy))};
    }
};

}  // namespace

// Runs entry(args) for every thread of every block. dyn_buffers are the buffers of the
// `extern __shared__` arrays (dyn_capacity bytes each, of which the launch asked for dyn_bytes).
int launch(void (*entry)(void**), void** args, const unsigned grid[3], const unsigned block[3],
           char* const* dyn_buffers, int n_dyn_buffers, size_t dyn_bytes, size_t dyn_capacity,
           const Schedule* sched, char* err, size_t err_len) {
    g_error = OK;
    g_msg[0] = 0;
    g_timeout_hit = 0;
    g_block_idx = uint3{0, 0, 0};
    g_block_dim = dim3(block[0], block[1], block[2]);
    g_grid_dim = dim3(grid[0], grid[1], grid[2]);
    g_n_threads = block[0] * block[1] * block[2];
    g_entry = entry;
    g_args = args;
    g_launch_thread = pthread_self();
    if (g_n_threads == 0 || g_n_threads > 1024 || dyn_bytes > dyn_capacity || sched->block_order > 2)
        set_error(BAD_LAUNCH, "bad launch configuration");
    else if (!ensure_fibers(g_n_threads))
        set_error(BAD_LAUNCH, "cannot map %u fiber stacks (out of memory?)", g_n_threads);
    if (g_error) {
        snprintf(err, err_len, "%s", g_msg);
        return g_error;
    }
#ifdef MINIKV_ASAN
    pthread_attr_t attr;  // where the scheduler's stack is, for the fiber switch annotations
    if (pthread_getattr_np(pthread_self(), &attr) == 0) {
        void* addr;
        pthread_attr_getstack(&attr, &addr, &g_main_stack_size);
        g_main_stack_bottom = addr;
        pthread_attr_destroy(&attr);
    }
    // Bytes past the requested dynamic shared memory are out of bounds.
    for (int i = 0; i < n_dyn_buffers && dyn_bytes < dyn_capacity; ++i)
        ASAN_POISON_MEMORY_REGION(dyn_buffers[i] + dyn_bytes, dyn_capacity - dyn_bytes);
#endif
    g_random_fibers = sched->random_fibers != 0;
    BlockOrder order(grid, *sched);
    install_signals();
    if (sigsetjmp(g_escape, 1) == 0) {
        for (uint64_t i = 0; i < order.total && !g_error; ++i) {
            g_block_idx = order.block(i);
            g_rng = sched->fiber_seed ^ (0x5851f42d4c957f2dull * (i + 1));  // each block its own stream
            // Shared memory starts out as garbage on a GPU; here it is all 0xff bytes.
            if (static_shared_bytes()) memset(__start_minikv_shared, 0xff, static_shared_bytes());
            for (int j = 0; j < n_dyn_buffers; ++j) memset(dyn_buffers[j], 0xff, dyn_bytes);
            run_block();
        }
    } else {  // a signal inside a fiber; the handler set g_error and g_msg
        g_in_fiber = 0;
        g_running = nullptr;
    }
    uninstall_signals();
#ifdef MINIKV_ASAN
    for (int i = 0; i < n_dyn_buffers; ++i) ASAN_UNPOISON_MEMORY_REGION(dyn_buffers[i], dyn_capacity);
#endif
    g_regs = nullptr;
    fflush(stdout);  // kernel printf output, before Python prints anything else
    snprintf(err, err_len, "%s", g_msg);
    return g_error;
}

// Bytes of static __shared__ memory in this module (0 under ASan, where it is not tracked).
size_t static_shared_bytes() { return (size_t)(__stop_minikv_shared - __start_minikv_shared); }

}  // namespace minikv_sim

#ifdef MINIKV_ASAN
// -fsanitize=alignment (ASan builds): a misaligned access, such as a float4 load through a pointer
// that is not 16-byte aligned, is a fault on a GPU ("misaligned address"). These definitions of
// the UBSan hooks (GCC's v1 ABI) are hidden in every module, so the module's checks call them
// rather than libubsan's, and the fault is reported like any other instead of printed.
namespace {
struct UbsanLocation { const char* file; unsigned line, column; };
struct UbsanType { unsigned short kind, info; char name[1]; };
struct UbsanTypeMismatch {
    UbsanLocation loc;
    const UbsanType* type;
    unsigned char log_alignment, check_kind;
};
void report_mismatch(const UbsanTypeMismatch* d, uintptr_t ptr) {
    const uintptr_t align = (uintptr_t)1 << d->log_alignment;
    if (!ptr || (ptr & (align - 1)) == 0) return;  // only alignment is checked
    if (minikv_sim::g_in_fiber)
        minikv_sim::fail(minikv_sim::FAULT, "misaligned address %p at %s:%u: a %s needs %lu-byte alignment (a "
                         "vector load or store through an offset pointer?)", (const void*)ptr, d->loc.file,
                         d->loc.line, d->type->name, (unsigned long)align);
    fprintf(stderr, "minikv_sim: misaligned address %p at %s:%u\n", (const void*)ptr, d->loc.file, d->loc.line);
    abort();
}
}  // namespace
extern "C" __attribute__((visibility("hidden"))) void __ubsan_handle_type_mismatch_v1(void* d, uintptr_t ptr) {
    report_mismatch((const UbsanTypeMismatch*)d, ptr);
}
extern "C" __attribute__((visibility("hidden"))) void __ubsan_handle_type_mismatch_v1_abort(void* d, uintptr_t ptr) {
    report_mismatch((const UbsanTypeMismatch*)d, ptr);
}
#endif

// assert() in a kernel: report it like __trap() instead of aborting the Python process.
extern "C" void __assert_fail(const char* expr, const char* file, unsigned int line, const char* func) noexcept {
    if (minikv_sim::g_in_fiber)
        minikv_sim::fail(minikv_sim::FAULT, "assertion `%s` failed in %s at %s:%u", expr, func, file, line);
    fprintf(stderr, "%s:%u: %s: Assertion `%s' failed.\n", file, line, func, expr);
    abort();
}
