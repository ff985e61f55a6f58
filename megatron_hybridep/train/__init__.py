"""The training harness that drives the plugin: what pretrain_moe.py, `hybridep bench`, the
benchmarks and the tests run. Above megatron/ (the integration) and runtime/; nothing below imports it.

- gpt.py: the one model builder (GPTModel chunks + Megatron DDP + optimizer) and the one training
  step (Megatron's schedule over all micro-batches, the optimizer step, the runtime's post-step)
- cpu_loop.py: pretrain_moe.py's loop on CPU (gloo): Megatron args -> gpt.py -> reporting
- gpu_pretrain.py: pretrain_moe.py on GPUs, through megatron.training.pretrain
- planning.py: the job's plan from the topology, model and flags; the runtime it needs
- reporting.py: progress lines, TensorBoard, the run summary
- checkpoint.py, data.py: --save/--load on CPU, the synthetic and Megatron datasets
- launch.py: N local ranks of a command (pretrain_moe.py's --nproc-per-node), stall monitor
"""
