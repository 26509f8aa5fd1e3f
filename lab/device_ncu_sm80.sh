#!/usr/bin/env bash
# ncu of the sm80 family (forced) against SDPA's FA2: executed instructions by opcode, stall reasons.
set -u
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/o}; mkdir -p $OUT/n
python3 -c "import cutlass_flash._C" 2>/dev/null || CUTLASS_FLASH_BINDING_ONLY=1 python3 setup.py build_ext --inplace > /tmp/b.log 2>&1 || tail /tmp/b.log
nvidia-smi --query-gpu=name --format=csv
M="smsp__inst_executed.sum,smsp__cycles_active.avg,sm__cycles_elapsed.max,smsp__thread_inst_executed_pred_on.sum,smsp__thread_inst_executed.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,smsp__inst_executed_op_ldsm.sum,sass__inst_executed_per_opcode,smsp__warp_issue_stalled_barrier_per_warp_active.pct,smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_short_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_math_pipe_throttle_per_warp_active.pct,smsp__warp_issue_stalled_wait_per_warp_active.pct,smsp__warp_issue_stalled_mio_throttle_per_warp_active.pct,smsp__warp_issue_stalled_not_selected_per_warp_active.pct,smsp__warp_issue_stalled_selected_per_warp_active.pct,smsp__warp_issue_stalled_dispatch_stall_per_warp_active.pct,smsp__warp_issue_stalled_no_instruction_per_warp_active.pct,smsp__warp_issue_stalled_lg_throttle_per_warp_active.pct,smsp__warp_issue_stalled_tex_throttle_per_warp_active.pct,smsp__warp_issue_stalled_branch_resolving_per_warp_active.pct,smsp__warp_issue_stalled_imc_miss_per_warp_active.pct,smsp__warp_issue_stalled_drain_per_warp_active.pct,smsp__warp_issue_stalled_membar_per_warp_active.pct,smsp__warp_issue_stalled_sleeping_per_warp_active.pct,smsp__warp_issue_stalled_misc_per_warp_active.pct,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size"
for cfg in "fwd 64 4096 0" "fwd 128 4096 0" "fwd 256 4096 0" "bwd 64 4096 0" "bwd 128 4096 0" "bwd 256 4096 0" "fwd 128 4096 1" "bwd 128 4096 1"; do
  set -- $cfg
  if [ $1 = fwd ]; then re="fwd_kernel|flash_fwd_kernel"; n=3; else re="bwd_kernel|flash_bwd_dq_dk_dv_loop"; n=2; fi
  CUTLASS_FLASH_FORCE_ARCH=80 timeout 150 ncu --kernel-name regex:"$re" \
    --launch-skip 1 --launch-count $n --metrics "$M" --print-metric-instances values \
    python3 lab/profile_attn.py $cfg fa2 > $OUT/n/ncu-$1-$2-$3-$4.txt 2>&1
  echo "$cfg rc $?"
done
tar -C $OUT -czf $OUT/ncu.tar.gz n && rm -rf $OUT/n
