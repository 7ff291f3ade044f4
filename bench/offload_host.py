"""The host-side kernels of CPU offload (docs/offload.md): ATen's fused AdamW, the gradient
additions and the casts, timed on N fp32 elements (median of 3) and scaled to llama_1b's
9.5e8 parameters. Run with the venv's python: python bench/offload_host.py [N]."""
import time, torch, sys
torch.manual_seed(0)
N = int(float(sys.argv[1])) if len(sys.argv) > 1 else 200_000_000
print("threads", torch.get_num_threads(), "N", N)
def t(f, reps=3):
    f(); ts=[]
    for _ in range(reps):
        s=time.perf_counter(); f(); ts.append(time.perf_counter()-s)
    ts.sort(); return ts[len(ts)//2]
p = torch.randn(N); g = torch.randn(N); m = torch.zeros(N); v = torch.zeros(N)
step = torch.zeros((), dtype=torch.float32)
gb = torch.randn(N).bfloat16()
def adamw():
    torch._fused_adamw_([p],[g],[m],[v],[],[step],lr=1e-4,beta1=0.9,beta2=0.95,weight_decay=0.1,eps=1e-8,amsgrad=False,maximize=False)
res = {}
res['fused_adamw fp32 (28 B/elem)'] = (t(adamw), 28)
res['add_ fp32+=fp32 (12 B/elem)'] = (t(lambda: g.add_(m)), 12)
res['add_ fp32+=bf16 (10 B/elem)'] = (t(lambda: g.add_(gb)), 10)
res['copy_ fp32<-bf16 (6 B/elem)'] = (t(lambda: g.copy_(gb)), 6)
res['copy_ bf16<-fp32 (6 B/elem)'] = (t(lambda: gb.copy_(p)), 6)
res['copy_ fp32<-fp32 (8 B/elem)'] = (t(lambda: g.copy_(m)), 8)
torch.set_num_threads(1)
res['fused_adamw 1 thread'] = (t(adamw), 28)
res['add_ fp32+=fp32 1 thread'] = (t(lambda: g.add_(m)), 12)
for k,(s,b) in res.items():
    print(f"{k:34s} {s*1e3:8.1f} ms  {N*b/s/1e9:6.1f} GB/s  -> 0.95B: {s*0.95e9/N*1e3:8.0f} ms")
