import torch
from tokenmill.kernels import reference, triton_ops
torch.manual_seed(0)
dev = "cuda"
for (T, H, D, static, cd) in [(33, 4, 512, False, torch.int8), (77, 2, 256, False, torch.int8), (33, 4, 512, False, torch.float8_e4m3fn), (9, 4, 128, True, torch.float8_e4m3fn), (9, 4, 128, True, torch.int8)]:
    nb, bs = 8, 16
    cos_sin = reference.rotary_cos_sin(1.0 / (10000.0 ** (torch.arange(0, D, 2, device=dev) / D)), 64)
    pos = torch.randint(0, 64, (T,), device=dev)
    slots = torch.randperm(nb * bs, device=dev)[:T].to(torch.int64)
    q = torch.randn(T, 2 * H, D, device=dev).bfloat16()
    k = (torch.randn(T, H, D, device=dev).bfloat16() * 3)
    v = torch.randn(T, H, D, device=dev).bfloat16()
    amax = torch.tensor([6.0, 1.5], device=dev) if static else None
    def mk(dt):
        s = (nb, bs, H)
        return [torch.zeros(*s, D, dtype=dt, device=dev), torch.zeros(*s, D, dtype=dt, device=dev),
                torch.zeros(s, dtype=torch.bfloat16, device=dev), torch.zeros(s, dtype=torch.bfloat16, device=dev)]
    ref, got = mk(cd), mk(cd)
    reference.rotary_embedding_and_write_kv(pos, q.clone(), k, v, cos_sin, ref[0], ref[1], slots, k_scale=ref[2], v_scale=ref[3], kv_amax=amax)
    triton_ops.rotary_embedding_and_write_kv(pos, q.clone(), k, v, cos_sin, got[0], got[1], slots, k_scale=got[2], v_scale=got[3], kv_amax=amax)
    # unquantized rotated k from both
    rb, gb = mk(torch.bfloat16), mk(torch.bfloat16)
    reference.rotary_embedding_and_write_kv(pos, q.clone(), k, v, cos_sin, rb[0], rb[1], slots)
    triton_ops.rotary_embedding_and_write_kv(pos, q.clone(), k, v, cos_sin, gb[0], gb[1], slots)
    flat = lambda x: x.view(nb * bs, *x.shape[2:])[slots]
    print(f"== T={T} H={H} D={D} static={static} {cd}")
    print("  bf16 rotated k unequal:", (flat(rb[0]) != flat(gb[0])).sum().item(), "max diff", (flat(rb[0]).float() - flat(gb[0]).float()).abs().max().item())
    for name, i in (("k", 0), ("v", 1)):
        rs, gs = flat(ref[2 + i]).float(), flat(got[2 + i]).float()
        bad = (rs != gs)
        print(f"  {name} scales unequal: {bad.sum().item()} of {bad.numel()}")
        if bad.any():
            idx = bad.nonzero()[:4]
            for t, h in idx.tolist():
                x = flat(rb[i])[t, h].float()
                print(f"    t={t} h={h} ref={rs[t,h].item():.6g} got={gs[t,h].item():.6g} amax={x.abs().max().item():.6g}  amax_got_from_q={flat(got[i])[t,h].float().abs().max().item()}")
        rq, gq = flat(ref[i]).float(), flat(got[i]).float()
        rd, gd = rq * rs[..., None], gq * gs[..., None]
        d = (rd - gd).abs()
        print(f"  {name} deq maxdiff {d.max().item():.4g}; q unequal {(rq != gq).sum().item()} of {rq.numel()}")
        if d.max() > 0:
            t, h, e = (d == d.max()).nonzero()[0].tolist()
            x = flat(rb[i])[t, h, e].float().item()
            print(f"    worst t={t} h={h} e={e} x={x:.6g} ref_q={rq[t,h,e].item()} got_q={gq[t,h,e].item()} ref_s={rs[t,h].item():.6g} got_s={gs[t,h].item():.6g}")
            # which elements differ: positions along D
            ne = (rq != gq).nonzero()
            print("    differing dims sample:", ne[:12, 2].tolist(), "heads", ne[:12,1].tolist(), "tokens", ne[:12,0].tolist())
