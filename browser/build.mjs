// Bundle the browser worker into backbone/static/worker/ (gitignored; `make install` runs this).
import { build } from "esbuild";
import { copyFileSync, mkdirSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const out = join(here, "..", "backbone", "static", "worker");
mkdirSync(out, { recursive: true });
await build({ entryPoints: [join(here, "src", "worker.js")], bundle: true, format: "iife", target: "es2020",
  outfile: join(out, "worker.js"), minify: false, legalComments: "inline", logLevel: "warning" });
await build({ entryPoints: [join(here, "src", "kernel.js")], bundle: true, format: "esm", target: "es2020",
  outfile: join(out, "kernel.mjs"), logLevel: "warning" });
copyFileSync(join(here, "index.html"), join(out, "index.html"));
console.error(`browser worker built into ${out}`);
