// Build the dashboard's front end into the Python package (src/dsec/ui/static/):
// app.js (one ES module: preact + htm + uPlot + Tabulator + our pages) and app.css.
// Run by scripts/bootstrap.sh after `npm ci`; no network, no CDN at run time.
import * as esbuild from "esbuild";
import { mkdirSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const out = join(here, "..", "src", "dsec", "ui", "static");
mkdirSync(out, { recursive: true });

await esbuild.build({
  entryPoints: { app: join(here, "src", "main.js") },
  bundle: true,
  format: "esm",
  target: ["es2020"],
  minify: true,
  legalComments: "eof",
  outdir: out,
  logLevel: "warning",
});
console.log(`built ${out}/app.js and app.css`);
