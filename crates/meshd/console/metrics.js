// Reads Prometheus text (`/metrics`) and turns counters into rates between reads.

// Parses the samples of the text format: [{name, labels, value}].
export function parse(text) {
  const out = [];
  for (const line of text.split('\n')) {
    if (!line || line.startsWith('#')) continue;
    const m = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)/.exec(line);
    if (!m) continue;
    const labels = {};
    if (m[3]) {
      for (const l of m[3].matchAll(/([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]] = l[2];
    }
    out.push({ name: m[1], labels, value: Number(m[4]) });
  }
  return out;
}

// The value of `name` per value of `label`.
export function byLabel(samples, name, label) {
  const out = new Map();
  for (const x of samples) if (x.name === name) out.set(x.labels[label], (out.get(x.labels[label]) || 0) + x.value);
  return out;
}

// Rates per key from successive counter readings, with a bounded history per key.
export class Rates {
  constructor(keep = 60) {
    this.keep = keep;
    this.last = null;
    this.history = new Map();
  }

  // `values`: Map key -> counter. Returns Map key -> rate per second (null first).
  update(values, at = performance.now()) {
    const rates = new Map();
    for (const [k, v] of values) {
      let r = null;
      if (this.last && this.last.values.has(k)) {
        const dt = (at - this.last.at) / 1000;
        const dv = v - this.last.values.get(k);
        r = dt > 0 && dv >= 0 ? dv / dt : 0;
      }
      rates.set(k, r);
      const h = this.history.get(k) || [];
      if (r !== null) h.push(r);
      while (h.length > this.keep) h.shift();
      this.history.set(k, h);
    }
    this.last = { at, values: new Map(values) };
    return rates;
  }

  series(k) {
    return this.history.get(k) || [];
  }
}
