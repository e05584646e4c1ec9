# switch_x86_64.S: the fiber context switch of the CPU simulator (x86-64, System V ABI).
#
# void minikv_switch(void** save_sp, void* load_sp)
#   Pushes the callee-saved registers of the running fiber onto its own stack, stores the
#   stack pointer in *save_sp, loads load_sp and pops the other fiber's registers from there.
#   Caller-saved registers need no saving: the C++ caller assumes a call clobbers them.
#   No system call (swapcontext makes one per switch to save the signal mask).
#
# A saved context, from the stack pointer upwards:
#   r15 r14 r13 r12 rbx rbp      callee-saved registers
#   return address               where the fiber resumes
# The MXCSR and x87 control words (rounding modes) are callee-saved too, but nothing in a
# kernel changes them, and restoring the x87 one costs more than the rest of the switch.

    .text
    .globl  minikv_switch
    .hidden minikv_switch
    .type   minikv_switch, @function
minikv_switch:
    pushq   %rbp
    pushq   %rbx
    pushq   %r12
    pushq   %r13
    pushq   %r14
    pushq   %r15
    movq    %rsp, (%rdi)        # save this fiber's stack pointer
    movq    %rsi, %rsp          # and continue on the other one
    popq    %r15
    popq    %r14
    popq    %r13
    popq    %r12
    popq    %rbx
    popq    %rbp
    ret
    .size   minikv_switch, .-minikv_switch

# A new fiber's first switch "returns" here, with its function in r13 and the argument in
# r12 (sim_runtime.cpp builds that first frame). The stack pointer is 16-byte aligned here,
# as the call requires; rbp is 0, which ends a debugger's backtrace.
    .globl  minikv_fiber_start
    .hidden minikv_fiber_start
    .type   minikv_fiber_start, @function
minikv_fiber_start:
    movq    %r12, %rdi
    callq   *%r13
    ud2                         # never reached: a finished fiber switches away for good
    .size   minikv_fiber_start, .-minikv_fiber_start

    .section .note.GNU-stack,"",@progbits   # this code needs no executable stack
