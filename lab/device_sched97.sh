#!/usr/bin/env bash
# PERFLOG 97's final check on a 2-GPU machine, one command: the sm80 family against SDPA's FA2 on
# the bf16 (5 rounds, GPU 0) and fp16 (3 rounds, GPU 1) grids, then the sm80 GPU tests of the
# forward's causal order (accuracy and sinks; misc, hardening, dropout, low-level, seqused).
#   OUT=$OUT bash lab/device_sched97.sh     (the library built here, carried)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
L=/tmp/f97; mkdir -p $L
G="--head-dims 64,128,256 --seqlens 1024,2048,4096,8192,16384 --budget-ms 40 --no-plot"
LOGS=$L TEST_TIMEOUT=${TEST_TIMEOUT:-200}
. lab/device_lib.sh
binding
(CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m cutlass_flash.benchmark --arch 80 --impls ours,sdpa-flash --dtype bf16 $G --rounds 5 --tag sm80-bf16-97 --out $L > $L/b0.log 2>&1; echo "bf16 rc $?"; shard 0 acc 80 tests/test_gpu_accuracy.py tests/test_sinks.py) > $L/g0.txt &
(CUDA_VISIBLE_DEVICES=1 timeout 200 python3 -m cutlass_flash.benchmark --arch 80 --impls ours,sdpa-flash --dtype fp16 $G --rounds 3 --tag sm80-fp16-97 --out $L > $L/b1.log 2>&1; echo "fp16 rc $?"; shard 1 misc 80 tests/test_gpu_misc.py tests/test_hardening.py tests/test_dropout.py tests/test_lowlevel.py tests/test_seqused.py) > $L/g1.txt &
wait; cat $L/g0.txt $L/g1.txt; grep -h "^FAILED" $L/tests-*.log | head
tar -C $L -czf $OUT/f97.tar.gz .
