import time, torch, torch.nn.functional as F
from astream.ops.triton_layer import add_rms_norm_triton, silu_mul_triton
dev="cuda"
x=torch.randn(1,2560,device=dev,dtype=torch.bfloat16); w=torch.randn(2560,2560,device=dev,dtype=torch.bfloat16)
w2=torch.randn(19456,2560,device=dev,dtype=torch.bfloat16); nw=torch.ones(2560,device=dev,dtype=torch.bfloat16)
gu=torch.randn(1,19456,device=dev,dtype=torch.bfloat16)
def host_us(fn, n=2000):
    for _ in range(50): fn()
    torch.cuda.synchronize()
    t=time.perf_counter()
    for _ in range(n): fn()
    h=(time.perf_counter()-t)/n*1e6
    torch.cuda.synchronize(); return round(h,1)
print("F.linear 2560x2560 M=1", host_us(lambda: F.linear(x,w)))
print("F.linear 19456x2560 M=1", host_us(lambda: F.linear(x,w2)))
print("torch.mm", host_us(lambda: torch.mm(x,w.t())))
print("x+x", host_us(lambda: x+x))
print("add_rms_norm_triton", host_us(lambda: add_rms_norm_triton(x,x,nw,1e-6)))
print("silu_mul_triton", host_us(lambda: silu_mul_triton(gu)))
import os
