"""Summarise an Nsight Compute source page (ncu -i R.ncu-rep --page source --csv --print-source sass):
warp-stall samples by reason over the kernel, then the instructions holding >= 0.6% of the samples
with their main reasons.  Usage: python experiments/kernels/ncu_stalls.py sass.csv
"""
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
hdr = rows[1]; data = rows[2:]
ix = {h: i for i, h in enumerate(hdr)}
st = [h for h in hdr[31:49]]
tot = {h: sum(int(r[ix[h]] or 0) for r in data) for h in st}
allsamp = sum(int(r[ix["Warp Stall Sampling (All Samples)"]] or 0) for r in data)
print("total samples", allsamp, "instructions", len(data))
for h, v in sorted(tot.items(), key=lambda x: -x[1]):
    if v: print(f"  {h:24s} {v:7d} {100*v/allsamp:5.1f}%")
top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
print("top instructions:")
for n, r in enumerate(data):
    s = int(r[ix["Warp Stall Sampling (All Samples)"]] or 0)
    if s >= allsamp * 0.006:
        br = ",".join(f"{h[6:]}={r[ix[h]]}" for h in st if int(r[ix[h]] or 0) >= max(2, s * 0.1))
        print(f"{n:5d} {s:6d} ex={r[ix['Instructions Executed']]:>7s} {r[1].strip()[:70]:70s} {br}")
