//! The suite's real Prometheus, through its HTTP API on loopback.

use std::collections::BTreeMap;

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use serde::de::DeserializeOwned;

use super::kube::Pod;
use crate::http;
use crate::plugin::METRICS_PORT;

/// The suite's scrape job that finds pods by their `prometheus.io/*` annotations, the
/// prometheus-community chart's `kubernetes-pods` job (cluster/prometheus.sh's config).
pub const POD_JOB: &str = "kubernetes-pods";

#[derive(Clone, Copy)]
pub struct Prometheus {
    pub port: u16,
}

/// What every API call answers: `data` on success, `error` otherwise.
#[derive(Deserialize)]
struct Answer<T> {
    status: String,
    #[serde(default)]
    error: String,
    data: Option<T>,
}

#[derive(Deserialize)]
struct Vector {
    result: Vec<Sample>,
}

/// A sample of an instant vector: its labels and its value as Prometheus prints it.
#[derive(Debug, Deserialize)]
pub struct Sample {
    pub metric: BTreeMap<String, String>,
    value: (f64, String),
}

impl Sample {
    pub fn value(&self) -> &str {
        &self.value.1
    }

    /// The value of `label`, `-` when the sample has none.
    pub fn label(&self, label: &str) -> &str {
        self.metric.get(label).map_or("-", String::as_str)
    }
}

#[derive(Deserialize)]
struct Alerts {
    alerts: Vec<Alert>,
}

/// An alert the rules hold now: pending or firing, or resolved a short while ago.
#[derive(Deserialize)]
struct Alert {
    labels: BTreeMap<String, String>,
    state: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Targets {
    active_targets: Vec<Target>,
}

/// A target Prometheus scrapes.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Target {
    pub labels: BTreeMap<String, String>,
    /// `up`, `down` or `unknown`.
    pub health: String,
    pub scrape_url: String,
    #[serde(default)]
    pub last_error: String,
}

impl Prometheus {
    /// From the URL the suite gives (`http://127.0.0.1:PORT`): Prometheus listens on loopback
    /// only.
    pub fn at(url: &str) -> Result<Prometheus> {
        let port = url
            .strip_prefix("http://127.0.0.1:")
            .and_then(|port| port.trim_end_matches('/').parse().ok())
            .with_context(|| format!("Prometheus at {url:?}, not on loopback"))?;
        Ok(Prometheus { port })
    }

    fn api<T: DeserializeOwned>(&self, path: &str) -> Result<T> {
        let body = http::get(self.port, path)?;
        let answer: Answer<T> =
            serde_json::from_str(&body).with_context(|| format!("{path}: not the API's JSON"))?;
        match answer.data {
            Some(data) if answer.status == "success" => Ok(data),
            _ => bail!("{path}: {} {}", answer.status, answer.error),
        }
    }

    /// The instant vector `expr` evaluates to.
    pub fn query(&self, expr: &str) -> Result<Vec<Sample>> {
        let vector: Vector = self
            .api(&format!("/api/v1/query?query={}", encode(expr)))
            .with_context(|| format!("query {expr}"))?;
        Ok(vector.result)
    }

    /// The active targets of the scrape job `job`.
    pub fn active_targets(&self, job: &str) -> Result<Vec<Target>> {
        let targets: Targets = self.api("/api/v1/targets?state=active")?;
        Ok(targets
            .active_targets
            .into_iter()
            .filter(|target| target.labels.get("job").is_some_and(|name| name == job))
            .collect())
    }

    /// Whether `alert` fires with each of `labels`; an empty value matches a missing label.
    pub fn firing(&self, alert: &str, labels: &[(&str, &str)]) -> Result<bool> {
        let matchers: String = labels
            .iter()
            .map(|(name, value)| format!(", {name}=\"{value}\""))
            .collect();
        let expr = format!("ALERTS{{alertname=\"{alert}\", alertstate=\"firing\"{matchers}}}");
        Ok(!self.query(&expr)?.is_empty())
    }

    /// The state of the alert `alert` whose label `label` has `value`, as the rules hold it:
    /// `pending`, `firing`, or `inactive` when they hold none.
    pub fn alert_state(&self, alert: &str, (label, value): (&str, &str)) -> Result<String> {
        let alerts: Alerts = self.api("/api/v1/alerts")?;
        Ok(alerts
            .alerts
            .into_iter()
            .find(|held| {
                held.labels
                    .get("alertname")
                    .is_some_and(|name| name == alert)
                    && held.labels.get(label).is_some_and(|held| held == value)
            })
            .map_or_else(|| "inactive".to_owned(), |held| held.state))
    }

    /// The alerts named `alert` as `device holder state` lines, for a failure's reason.
    pub fn alerts(&self, alert: &str) -> String {
        match self.query(&format!("ALERTS{{alertname=\"{alert}\"}}")) {
            Ok(samples) => samples
                .iter()
                .map(|sample| {
                    format!(
                        "{} {} {}",
                        sample.label("device"),
                        sample.label("holder"),
                        sample.label("alertstate")
                    )
                })
                .collect::<Vec<_>>()
                .join("|"),
            Err(err) => format!("(cannot ask Prometheus: {err:#})"),
        }
    }

    /// The job's active targets as `health scrapeUrl lastError` lines, for a failure's reason.
    pub fn targets(&self, job: &str) -> String {
        match self.active_targets(job) {
            Ok(targets) => targets
                .iter()
                .map(|target| {
                    format!(
                        "{} {} {}",
                        target.health, target.scrape_url, target.last_error
                    )
                })
                .collect::<Vec<_>>()
                .join("|"),
            Err(err) => format!("(cannot ask Prometheus: {err:#})"),
        }
    }
}

/// Whether `targets` holds the plugin pod `pod`'s metrics endpoint, and finds it up.
pub fn scrapes(targets: &[Target], pod: &Pod) -> bool {
    let url = format!("http://{}:{METRICS_PORT}/metrics", pod.status.pod_ip);
    !pod.status.pod_ip.is_empty()
        && targets
            .iter()
            .any(|target| target.scrape_url == url && target.health == "up")
}

/// A query string value, percent-encoded but for RFC 3986's unreserved characters.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|byte| match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                char::from(byte).to_string()
            }
            _ => format!("%{byte:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_query_is_percent_encoded() {
        assert_eq!(
            encode(r#"ALERTS{alertname="A b"}"#),
            "ALERTS%7Balertname%3D%22A%20b%22%7D"
        );
    }

    #[test]
    fn a_samples_labels_and_value_are_read_from_the_answer() {
        let answer: Answer<Vector> = serde_json::from_str(
            r#"{"status": "success", "data": {"resultType": "vector", "result": [
                {"metric": {"node": "efa-b", "pod": "hold-b"}, "value": [1733450000.5, "4"]}]}}"#,
        )
        .unwrap();
        let [sample] = answer.data.unwrap().result.try_into().unwrap();
        assert_eq!(
            (
                sample.label("node"),
                sample.label("namespace"),
                sample.value()
            ),
            ("efa-b", "-", "4")
        );
    }

    #[test]
    fn an_alerts_state_is_read_from_the_alerts_it_holds() {
        let answer: Answer<Alerts> = serde_json::from_str(
            r#"{"status": "success", "data": {"alerts": [
                {"labels": {"alertname": "EfaDeviceUnhealthy", "ibdev": "rdmap160s27"},
                 "state": "pending", "activeAt": "2026-12-06T22:00:00Z", "value": "1e+00"}]}}"#,
        )
        .unwrap();
        let [alert] = answer.data.unwrap().alerts.try_into().ok().unwrap();
        assert_eq!(
            (alert.labels["ibdev"].as_str(), alert.state.as_str()),
            ("rdmap160s27", "pending")
        );
    }

    #[test]
    fn prometheus_is_found_on_loopback_only() {
        assert_eq!(
            Prometheus::at("http://127.0.0.1:19090").unwrap().port,
            19090
        );
        assert!(Prometheus::at("http://198.18.0.1:19090").is_err());
    }
}
