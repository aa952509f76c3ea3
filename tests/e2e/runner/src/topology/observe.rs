//! What the topology cases read from the daemons' logs: the plugin's GetPreferredAllocation
//! answers (its debug line for each) and the kubelet's `TopologyHints` lines.

use std::sync::LazyLock;

use regex::Regex;

static GPA: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"answered GetPreferredAllocation.* offered=(\S*) must_include=(\S*) size=(-?\d+) answer=(\S*)",
    )
    .expect("the GPA line's pattern is valid")
});
static CONTAINER: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"containerName="([^"]*)""#).expect("the container pattern is valid")
});
/// klog writes the hints as JSON, each mask as its integer value (bit n: node n).
static HINT: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#""NUMANodeAffinity":(\d+|null),"Preferred":(true|false)"#)
        .expect("the hint pattern is valid")
});

/// One GetPreferredAllocation answer of the plugin, its ID lists as logged (comma-separated,
/// possibly empty).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gpa {
    pub offered: String,
    pub must: String,
    pub size: String,
    pub answer: String,
}

impl Gpa {
    /// `GPA offered [..] must [..] size N -> [..]`, as a case's line quotes it.
    pub fn summary(&self) -> String {
        format!(
            "GPA offered [{}] must [{}] size {} -> [{}]",
            self.offered, self.must, self.size, self.answer
        )
    }
}

/// The IDs of a comma-separated list, sorted as the checkpoint's reader sorts them.
pub fn sorted_ids(list: &str) -> Vec<String> {
    let mut ids: Vec<String> = list
        .split(',')
        .filter(|id| !id.is_empty())
        .map(str::to_owned)
        .collect();
    ids.sort();
    ids
}

/// Every answer the plugin logged, in order.
pub fn gpa_answers(log: &str) -> Vec<Gpa> {
    log.lines()
        .filter_map(|line| GPA.captures(line))
        .map(|c| Gpa {
            offered: c[1].to_owned(),
            must: c[2].to_owned(),
            size: c[3].to_owned(),
            answer: c[4].to_owned(),
        })
        .collect()
}

/// The hints of the kubelet's `TopologyHints` lines for static pod `pod` (its full name) and
/// `resource`, one string per line logged: `CONTAINER NODES:PREFERRED ...`, NODES the mask's
/// NUMA nodes comma-separated (`any` for no mask; CONTAINER `-` in pod scope), or
/// `CONTAINER null` when the kubelet had no preference.
pub fn hints(log: &str, pod: &str, resource: &str) -> Vec<String> {
    let pod = format!("pod=\"default/{pod}\"");
    log.lines()
        .filter(|line| line.contains("\"TopologyHints\"") && line.contains(&pod))
        .filter_map(|line| {
            let section = resource_section(line, resource)?;
            let container = CONTAINER
                .captures(line)
                .map_or("-".to_owned(), |c| c[1].to_owned());
            let masks: Vec<String> = match section {
                None => vec!["null".to_owned()],
                Some(section) => HINT
                    .captures_iter(section)
                    .map(|c| format!("{}:{}", nodes(&c[1]), &c[2]))
                    .collect(),
            };
            Some(
                std::iter::once(container)
                    .chain(masks)
                    .collect::<Vec<_>>()
                    .join(" "),
            )
        })
        .collect()
}

/// The text of the hint list logged for `resource` (`Some(None)`: logged as null), or `None`
/// when the line does not name it.
fn resource_section<'a>(line: &'a str, resource: &str) -> Option<Option<&'a str>> {
    if line.contains(&format!("\"{resource}\":null")) {
        return Some(None);
    }
    let key = format!("\"{resource}\":[");
    let start = line.find(&key)? + key.len();
    let mut depth = 1;
    for (i, c) in line[start..].char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            _ => {}
        }
        if depth == 0 {
            return Some(Some(&line[start..start + i]));
        }
    }
    None
}

/// The NUMA nodes of a mask, comma-separated; `any` for `null`.
fn nodes(mask: &str) -> String {
    let Ok(value) = mask.parse::<u64>() else {
        return "any".to_owned();
    };
    (0..64)
        .filter(|n| value >> n & 1 == 1)
        .map(|n| n.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    const KUBELET: &str = r#"I1203 20:07:06.589566   26369 scope_container.go:83] "TopologyHints" hints={"vpc.amazonaws.com/efa":[{"NUMANodeAffinity":1,"Preferred":true},{"NUMANodeAffinity":2,"Preferred":true},{"NUMANodeAffinity":3,"Preferred":false}]} pod="default/t0-efa-e2e" containerName="net"
I1203 20:07:06.589638   26369 scope_container.go:83] "TopologyHints" hints=null pod="default/t0-efa-e2e" containerName="net"
I1203 20:08:14.264631   26369 scope_container.go:83] "TopologyHints" hints={"nvidia.com/gpu":[{"NUMANodeAffinity":1,"Preferred":true}],"vpc.amazonaws.com/efa":null} pod="default/t9-efa-e2e" containerName="job"
I1203 20:08:15.000000   26369 scope_pod.go:83] "TopologyHints" hints={"vpc.amazonaws.com/efa":[{"NUMANodeAffinity":2,"Preferred":true}]} pod="default/t7p-efa-e2e"
"#;

    #[test]
    fn hints_are_read_per_pod_and_resource() {
        let efa = "vpc.amazonaws.com/efa";
        assert_eq!(
            hints(KUBELET, "t0-efa-e2e", efa),
            ["net 0:true 1:true 0,1:false"]
        );
        assert_eq!(hints(KUBELET, "t9-efa-e2e", efa), ["job null"]);
        assert_eq!(
            hints(KUBELET, "t9-efa-e2e", "nvidia.com/gpu"),
            ["job 0:true"]
        );
        assert_eq!(hints(KUBELET, "t7p-efa-e2e", efa), ["- 1:true"]);
        assert!(hints(KUBELET, "t1-efa-e2e", efa).is_empty());
    }

    #[test]
    fn gpa_answers_are_read_in_order_with_empty_lists() {
        let log = "2026-12-03T20:07:06.590465Z DEBUG answered GetPreferredAllocation offered=rdmap32s27,rdmap16s27 must_include= size=1 answer=rdmap16s27\n\
            2026-12-03T20:07:07Z INFO something else\n\
            2026-12-03T20:07:11.942592Z DEBUG answered GetPreferredAllocation offered=b,a must_include=a size=2 answer=a,b\n";
        let answers = gpa_answers(log);
        assert_eq!(answers.len(), 2);
        assert_eq!(
            answers[0].summary(),
            "GPA offered [rdmap32s27,rdmap16s27] must [] size 1 -> [rdmap16s27]"
        );
        assert_eq!(sorted_ids(&answers[1].offered), ["a", "b"]);
        assert_eq!(sorted_ids(&answers[0].must), Vec::<String>::new());
    }

    #[test]
    fn a_mask_names_its_nodes() {
        assert_eq!(nodes("3"), "0,1");
        assert_eq!(nodes("2"), "1");
        assert_eq!(nodes("null"), "any");
    }
}
