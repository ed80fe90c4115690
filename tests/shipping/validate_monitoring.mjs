// Validate Prometheus Operator objects (JSON array on stdin) with @kubernetes-models/prometheus-operator,
// whose validators are generated from the operator's CRD schemas. Prints one line per invalid object
// ("Kind/name: message") and exits 1 when any is invalid. Run from .tools/node (`make tools`).
import { PodMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor";
import { ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor";
import { PrometheusRule } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule";

const MODELS = { PodMonitor, ServiceMonitor, PrometheusRule };
let input = "";
for await (const chunk of process.stdin) input += chunk;
let bad = 0;
for (const obj of JSON.parse(input)) {
  const Model = MODELS[obj.kind];
  if (!Model) { console.log(`${obj.kind}/${obj.metadata.name}: no model`); bad++; continue; }
  try { new Model(obj).validate(); console.log(`ok ${obj.kind}/${obj.metadata.name}`); }
  catch (e) { console.log(`${obj.kind}/${obj.metadata.name}: ${e.message}`); bad++; }
}
process.exit(bad ? 1 : 0);
