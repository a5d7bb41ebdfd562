# Bus bandwidth vs message size, one panel per collective, one line per world size.
#
#   gnuplot -e "dir='report/bench'; out='report/bench/busbw.png'" benchmarks/plot_busbw.gp
#
# Reads dir/busbw_<collective>_np<ranks>.dat (written by scripts/bench-collectives.sh):
# whitespace-separated columns: bytes, algbw GB/s, busbw GB/s, mean and median us per call.
# dir/busbw_pytorch_<collective>_np<ranks>.dat, when present, is drawn dashed in the
# collective's panel (torch.distributed's Gloo backend measured the same way).
# Optional: ranks='2 4' (world sizes to draw), title='...'.

if (!exists("dir")) dir = "report/bench"
if (!exists("out")) out = dir . "/busbw.png"
if (!exists("ranks")) ranks = "2 4"
if (!exists("title")) title = "dtrain Gloo collectives: fp32, one process per rank, loopback TCP"

set terminal pngcairo size 900,640 font "sans,9"
set output out

collectives = "all_reduce all_gather reduce_scatter broadcast"
file(op, n) = sprintf("%s/busbw_%s_np%s.dat", dir, op, n)
exists_file(f) = system("test -s '" . f . "' && echo 1 || echo 0") + 0
# One colour per world size, shared by dtrain (solid) and PyTorch (dashed).
color(i) = word("#1f77b4 #d62728 #2ca02c #9467bd #ff7f0e", (i - 1) % 5 + 1)
size_label(e) = e >= 30 ? sprintf("%dG", 2**(e - 30)) : e >= 20 ? sprintf("%dM", 2**(e - 20)) \
              : sprintf("%dK", 2**(e - 10))

set logscale x 2
set xtics ()
do for [e = 10:34:2] { set xtics add (size_label(e) 2**e) }
set grid xtics ytics
set xlabel "message size (bytes)"
set ylabel "bus bandwidth (GB/s)"
set yrange [0:*]
set key top left noenhanced opaque reverse Left samplen 2
set offsets graph 0.03, graph 0.03, graph 0.05, 0

# Plot commands are assembled as strings so that missing series are simply left out.
set multiplot layout 2,2 title title
do for [op in collectives] {
  set title op noenhanced
  cmd = ""
  do for [i = 1:words(ranks)] {
    n = word(ranks, i)
    f = file(op, n)
    if (exists_file(f)) {
      cmd = cmd . (cmd eq "" ? "" : ", ") . sprintf("'%s' using 1:3 with linespoints lw 2 " \
            . "pt 7 ps 0.6 lc rgb '%s' title 'dtrain, %s ranks'", f, color(i), n)
    }
    f = file("pytorch_" . op, n)
    if (exists_file(f)) {
      cmd = cmd . (cmd eq "" ? "" : ", ") . sprintf("'%s' using 1:3 with linespoints lw 1 " \
            . "dt 2 pt 6 ps 0.6 lc rgb '%s' title 'PyTorch Gloo, %s ranks'", f, color(i), n)
    }
  }
  if (cmd ne "") { eval("plot " . cmd) } else { set multiplot next }
}
unset multiplot
