// A time-series chart: a thin Preact wrapper around uPlot (the library draws, scales,
// formats the axes and shows the cursor values; this only feeds it data).
import { html } from "htm/preact";
import { useEffect, useRef } from "preact/hooks";
import uPlot from "uplot";

const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2"];

// props: title, t (unix seconds), series: [{label, values, unit}], height, testid,
// span: seconds the x axis covers, ending now (default: the data's own range)
export function Chart({ title, t, series, height = 160, testid, span }) {
  const box = useRef(null);
  const plot = useRef(null);
  const shape = series.map((s) => s.label).join("|");

  useEffect(() => {
    const el = box.current;
    const opts = {
      width: Math.max(240, el.clientWidth || 400),
      height,
      legend: { live: true },
      scales: {
        x: {
          time: true,
          range: span
            ? () => {
                const now = Date.now() / 1000;
                return [now - span, now];
              }
            : undefined,
        },
      },
      axes: [{}, { size: 56 }],
      series: [
        {},
        ...series.map((s, i) => ({
          label: s.label,
          stroke: COLORS[i % COLORS.length],
          width: 1.5,
          spanGaps: false,
          points: { show: true, size: 3 },
          value: (_u, v) => (v === null || v === undefined ? "–" : `${+v.toFixed(2)}${s.unit || ""}`),
        })),
      ],
    };
    plot.current = new uPlot(opts, [t, ...series.map((s) => s.values)], el);
    const resize = new ResizeObserver(() => {
      if (plot.current) plot.current.setSize({ width: Math.max(240, el.clientWidth), height });
    });
    resize.observe(el);
    return () => {
      resize.disconnect();
      plot.current.destroy();
      plot.current = null;
    };
  }, [shape, height]);

  useEffect(() => {
    if (plot.current) plot.current.setData([t, ...series.map((s) => s.values)]);
  });

  return html`<figure class="chart" data-testid=${testid}>
    <figcaption>${title}</figcaption>
    <div ref=${box} class="chart-box"></div>
  </figure>`;
}
