//! The topology suite's cases (T0 to T11 of the GPU–EFA alignment issue). Each starts from no
//! pods and names the policy, scope and host it needs; the table orders them so the kubelet
//! restarts once per policy group. Exact device IDs are asserted only where the plugin's
//! GetPreferredAllocation answer decides (the request is smaller than the aligned set);
//! elsewhere the kubelet picks at random and only the NUMA nodes are asserted.
//!
//! T1 to T10 run BestEffort pods: device alignment is not limited to Guaranteed ones. T11 is
//! the one Guaranteed pod, for the CPU manager. Pod names are unique within a run: a static
//! pod's UID comes from its manifest, and the kubelet would hand a recreated pod the devices
//! its checkpoint still holds for that UID.

use anyhow::{Result, bail};

use super::{Container, GPU, GPU_ENV, Host, Policy, Scope, Topology, TopologyPolicy};
use crate::cases::Detail;
use crate::node::{RESOURCE, ensure};

const SINGLE_NUMA_NODE: Policy = Policy::new(TopologyPolicy::SingleNumaNode, Scope::Container);
const RESTRICTED: Policy = Policy::new(TopologyPolicy::Restricted, Scope::Container);
const BEST_EFFORT: Policy = Policy::new(TopologyPolicy::BestEffort, Scope::Container);

const LOCALITY: &str = "Resources cannot be allocated with Topology locality";

fn spaced(ids: &[String]) -> String {
    ids.join(" ")
}

/// A pod `<name>-gpu` holding GPU-0: on a free node every policy puts a 1-GPU pod on the
/// lower NUMA node.
fn hold_gpu0(t: &mut Topology, name: &str) -> Result<()> {
    let holder = format!("{name}-gpu");
    t.expect_running(&holder, &[Container::app("hold", 0, 1)])?;
    let got = t.ids_of(&holder, GPU, None);
    ensure(got == ["GPU-0"], || {
        format!("the GPU holder got [{}], want GPU-0", spaced(&got))
    })
}

/// Exactly one answer since the last pod was written, for an offer of exactly `offered` (any
/// order) with nothing to keep and `size`; the answer, sorted.
fn expect_one_gpa(t: &Topology, offered: &[String], size: u32) -> Result<Vec<String>> {
    let answers = t.new_gpa();
    let [gpa] = answers.as_slice() else {
        bail!(
            "{} GetPreferredAllocation answers logged, want 1: {}",
            answers.len(),
            t.gpa_summary()
        );
    };
    let must: Vec<String> = super::observe::sorted_ids(&gpa.must);
    if super::observe::sorted_ids(&gpa.offered) != offered
        || !must.is_empty()
        || gpa.size != size.to_string()
    {
        bail!(
            "the kubelet offered [{}] must [{}] size {}, want [{}] must [] size {size}",
            gpa.offered,
            gpa.must,
            gpa.size,
            spaced(offered)
        );
    }
    Ok(super::observe::sorted_ids(&gpa.answer))
}

/// The checkpoint gives the pod (its `container`) exactly `ids` (`None`: any) under exactly
/// the NUMA keys `keys`.
fn expect_devices(
    t: &Topology,
    name: &str,
    resource: &str,
    container: Option<&str>,
    ids: Option<&[String]>,
    keys: &str,
) -> Result<()> {
    let got = t.ids_of(name, resource, container);
    let got_keys = t.numa_keys_of(name, resource, container);
    if ids.is_some_and(|ids| got != ids) || got_keys != keys {
        bail!(
            "checkpoint gives {} {name} {resource} [{}] under NUMA keys [{got_keys}], want [{}] under [{keys}]",
            container.unwrap_or("pod"),
            spaced(&got),
            ids.map_or("*".to_owned(), spaced)
        );
    }
    Ok(())
}

/// The stand-in's variable in the container is `want`.
fn expect_gpu_env(t: &Topology, name: &str, container: &str, want: &str) -> Result<()> {
    let got = t.gpu_env_of(name, container);
    ensure(got == want, || {
        format!("{GPU_ENV} in {name}/{container} is [{got}], want [{want}]")
    })
}

/// Container `job` got the EFAs `ids` under key `numa`, and GPU-1 (key 1), which it also
/// sees in the stand-in's variable.
fn expect_gpu1_job(t: &Topology, name: &str, ids: &[String], numa: &str) -> Result<()> {
    expect_devices(t, name, RESOURCE, Some("job"), Some(ids), numa)?;
    expect_devices(t, name, GPU, Some("job"), Some(&["GPU-1".to_owned()]), "1")?;
    expect_gpu_env(t, name, "job", "GPU-1")
}

/// Rejected by the Topology Manager; the pod's phase, reason and message.
fn expect_locality_error(t: &mut Topology, name: &str, containers: &[Container]) -> Result<Detail> {
    let status = t.expect_rejected(name, "TopologyAffinityError", containers)?;
    let crate::kubelet::PodStatus::Listed {
        phase,
        reason,
        message,
        ..
    } = status
    else {
        bail!("pod {name} rejected but not listed");
    };
    ensure(message.contains(LOCALITY), || {
        format!("pod {name} rejected with message [{message}]")
    })?;
    Ok(format!("{phase}/{reason}: {message}"))
}

/// T0: the kubelet sees two NUMA nodes: its hints for one EFA include node 1 alone, and with
/// everything free it picks node 0 and offers GPA only that node's EFAs.
pub fn hints_see_two_nodes(t: &mut Topology) -> Result<Detail> {
    t.fresh(SINGLE_NUMA_NODE, Host::P4d)?;
    t.expect_running("t0", &[Container::app("net", 1, 0)])?;
    let hints = t.hints_of("t0", RESOURCE);
    let node1_alone = hints
        .lines()
        .any(|line| line.split(' ').any(|hint| hint == "1:true"));
    ensure(node1_alone, || {
        format!("kubelet hints for {RESOURCE}: [{hints}], want a preferred hint for node 1 alone")
    })?;
    let answer = expect_one_gpa(t, &t.ids(Host::P4d, Some(0)), 1)?;
    expect_devices(t, "t0", RESOURCE, Some("net"), Some(&answer), "0")?;
    Ok(format!(
        "hints [{hints}]; {}; got [{}] on node 0",
        t.gpa_summary(),
        spaced(&answer)
    ))
}

/// T1: GPU-0 held; 1 GPU + 1 EFA gets GPU-1 and the NUMA-1 EFA the plugin's GPA prefers,
/// three times over.
pub fn efa_follows_the_free_gpu(t: &mut Topology) -> Result<Detail> {
    t.fresh(SINGLE_NUMA_NODE, Host::P4d)?;
    hold_gpu0(t, "t1")?;
    let mut runs = Vec::new();
    for pod in ["t1a", "t1b", "t1c"] {
        t.expect_running(pod, &[Container::app("job", 1, 1)])?;
        let answer = expect_one_gpa(t, &t.ids(Host::P4d, Some(1)), 1)?;
        expect_gpu1_job(t, pod, &answer, "1")?;
        runs.push(format!(
            "GPU-1 + [{}] (key 1), {}",
            spaced(&answer),
            t.gpa_summary()
        ));
        t.drop_pod(pod)?;
    }
    Ok(runs.join("|"))
}

/// T2: GPU-0 held; 1 GPU + 2 EFA gets GPU-1 and both NUMA-1 EFAs.
pub fn both_efas_of_the_gpu_node(t: &mut Topology) -> Result<Detail> {
    t.fresh(SINGLE_NUMA_NODE, Host::P4d)?;
    hold_gpu0(t, "t2")?;
    t.expect_running("t2", &[Container::app("job", 2, 1)])?;
    expect_gpu1_job(t, "t2", &t.ids(Host::P4d, Some(1)), "1")?;
    Ok(format!(
        "GPU-1 + [{}] (key 1); {}",
        spaced(&t.ids_of("t2", RESOURCE, None)),
        t.gpa_summary()
    ))
}

/// T2b: p5en, GPU-0 held; 1 GPU + 2 EFA gets two NUMA-1 EFAs behind one switch.
pub fn p5en_pair_behind_one_switch(t: &mut Topology) -> Result<Detail> {
    t.fresh(SINGLE_NUMA_NODE, Host::P5en)?;
    hold_gpu0(t, "t2b")?;
    t.expect_running("t2b", &[Container::app("job", 2, 1)])?;
    let answer = expect_one_gpa(t, &t.ids(Host::P5en, Some(1)), 2)?;
    expect_devices(t, "t2b", RESOURCE, Some("job"), Some(&answer), "1")?;
    expect_devices(t, "t2b", GPU, Some("job"), Some(&["GPU-1".to_owned()]), "1")?;
    let switch = |i: usize| answer.get(i).map(|id| t.switch_of(id)).unwrap_or_default();
    ensure(switch(0) == switch(1), || {
        format!(
            "[{}] are behind switches {} and {}, want one",
            spaced(&answer),
            switch(0),
            switch(1)
        )
    })?;
    Ok(format!(
        "GPU-1 + [{}] behind {}; {}",
        spaced(&answer),
        switch(0),
        t.gpa_summary()
    ))
}

/// T3: single-numa-node: 3 EFA fit no single node.
pub fn three_efas_fit_no_node(t: &mut Topology) -> Result<Detail> {
    t.fresh(SINGLE_NUMA_NODE, Host::P4d)?;
    expect_locality_error(t, "t3", &[Container::app("job", 3, 0)])
}

/// T4: restricted: 3 EFA run on both nodes, the 3 the plugin's GPA picks of all 4.
pub fn restricted_spans_both_nodes(t: &mut Topology) -> Result<Detail> {
    t.fresh(RESTRICTED, Host::P4d)?;
    t.expect_running("t4", &[Container::app("job", 3, 0)])?;
    let answer = expect_one_gpa(t, &t.ids(Host::P4d, None), 3)?;
    expect_devices(t, "t4", RESOURCE, Some("job"), Some(&answer), "0 1")?;
    Ok(format!(
        "[{}] (keys 0 1); {}",
        spaced(&answer),
        t.gpa_summary()
    ))
}

/// T5: 1 GPU + 3 EFA on an empty node: restricted rejects (the GPU's narrowest mask is one
/// node, the EFAs' two), best-effort admits.
pub fn restricted_rejects_gpu_with_three_efas(t: &mut Topology) -> Result<Detail> {
    t.fresh(RESTRICTED, Host::P4d)?;
    expect_locality_error(t, "t5r", &[Container::app("job", 3, 1)])
}

pub fn best_effort_admits_gpu_with_three_efas(t: &mut Topology) -> Result<Detail> {
    t.fresh(BEST_EFFORT, Host::P4d)?;
    t.expect_running("t5b", &[Container::app("job", 3, 1)])?;
    expect_devices(t, "t5b", RESOURCE, Some("job"), None, "0 1")?;
    Ok(format!(
        "GPU [{}] + [{}] (keys {}); {}",
        spaced(&t.ids_of("t5b", GPU, None)),
        spaced(&t.ids_of("t5b", RESOURCE, None)),
        t.numa_keys_of("t5b", RESOURCE, None),
        t.gpa_summary()
    ))
}

/// GPU-0 and one NUMA-1 EFA held, GPU-1 and the NUMA-0 EFAs free. A 2-EFA pod fills node 0
/// first (the lower of two preferred masks), so a 1-EFA pod then lands on node 1.
fn hold_gpu0_and_a_numa1_efa(t: &mut Topology, name: &str) -> Result<()> {
    let two = format!("{name}-2");
    t.expect_running(&two, &[Container::app("hold", 2, 0)])?;
    let keys = t.numa_keys_of(&two, RESOURCE, None);
    ensure(keys == "0", || {
        format!("the 2-EFA holder is on [{keys}], want node 0")
    })?;
    let one = format!("{name}-1");
    t.expect_running(&one, &[Container::app("hold", 1, 0)])?;
    let keys = t.numa_keys_of(&one, RESOURCE, None);
    ensure(keys == "1", || {
        format!("the 1-EFA holder is on [{keys}], want node 1")
    })?;
    t.drop_pod(&two)?;
    hold_gpu0(t, name)
}

/// T6: with that, 1 GPU + 2 EFA cannot be aligned: best-effort admits it misaligned,
/// restricted and single-numa-node reject it.
pub fn best_effort_admits_misaligned(t: &mut Topology) -> Result<Detail> {
    t.fresh(BEST_EFFORT, Host::P4d)?;
    hold_gpu0_and_a_numa1_efa(t, "t6b")?;
    t.expect_running("t6b", &[Container::app("job", 2, 1)])?;
    expect_gpu1_job(t, "t6b", &t.ids(Host::P4d, Some(0)), "0")?;
    Ok(format!(
        "misaligned: GPU-1 (node 1) + [{}] (node 0); {}",
        spaced(&t.ids_of("t6b", RESOURCE, None)),
        t.gpa_summary()
    ))
}

pub fn restricted_rejects_misaligned(t: &mut Topology) -> Result<Detail> {
    t.fresh(RESTRICTED, Host::P4d)?;
    hold_gpu0_and_a_numa1_efa(t, "t6r")?;
    expect_locality_error(t, "t6r", &[Container::app("job", 2, 1)])
}

pub fn single_numa_node_rejects_misaligned(t: &mut Topology) -> Result<Detail> {
    t.fresh(SINGLE_NUMA_NODE, Host::P4d)?;
    hold_gpu0_and_a_numa1_efa(t, "t6s")?;
    expect_locality_error(t, "t6s", &[Container::app("job", 2, 1)])
}

/// T7: GPU-0 held; containers gpu (1 GPU) and net (1 EFA). Container scope aligns net alone
/// (node 0, the lower); pod scope with the GPU (node 1).
fn scope_alignment(t: &mut Topology, pod: &str, scope: Scope, node: i64) -> Result<Detail> {
    t.fresh(
        Policy::new(TopologyPolicy::SingleNumaNode, scope),
        Host::P4d,
    )?;
    hold_gpu0(t, pod)?;
    t.expect_running(
        pod,
        &[Container::app("gpu", 0, 1), Container::app("net", 1, 0)],
    )?;
    let answer = expect_one_gpa(t, &t.ids(Host::P4d, Some(node)), 1)?;
    expect_devices(
        t,
        pod,
        RESOURCE,
        Some("net"),
        Some(&answer),
        &node.to_string(),
    )?;
    expect_devices(t, pod, GPU, Some("gpu"), Some(&["GPU-1".to_owned()]), "1")?;
    expect_gpu_env(t, pod, "gpu", "GPU-1")?;
    Ok(format!(
        "gpu GPU-1, net [{}] (node {node}); {}",
        spaced(&answer),
        t.gpa_summary()
    ))
}

pub fn container_scope_aligns_net_alone(t: &mut Topology) -> Result<Detail> {
    scope_alignment(t, "t7c", Scope::Container, 0)
}

pub fn pod_scope_aligns_net_with_gpu(t: &mut Topology) -> Result<Detail> {
    scope_alignment(t, "t7p", Scope::Pod, 1)
}

/// T8: restricted: 5 EFA, more than there are, is a locality error too.
pub fn too_many_efas_is_a_locality_error(t: &mut Topology) -> Result<Detail> {
    t.fresh(RESTRICTED, Host::P4d)?;
    expect_locality_error(t, "t8", &[Container::app("job", 5, 0)])
}

/// T9: g5-shaped (no NUMA node): 1 GPU + 2 EFA is admitted; the EFAs are under key -1 and
/// the plugin's GPA picks them from all four.
pub fn no_numa_node_admitted(t: &mut Topology) -> Result<Detail> {
    t.fresh(SINGLE_NUMA_NODE, Host::G5)?;
    t.expect_running("t9", &[Container::app("job", 2, 1)])?;
    let answer = expect_one_gpa(t, &t.ids(Host::G5, None), 2)?;
    expect_devices(t, "t9", RESOURCE, Some("job"), Some(&answer), "-1")?;
    Ok(format!(
        "GPU [{}] + [{}] (key -1); hints [{}]; {}",
        spaced(&t.ids_of("t9", GPU, None)),
        spaced(&answer),
        t.hints_of("t9", RESOURCE),
        t.gpa_summary()
    ))
}

/// T10: p5en: an init container's EFA is reused by the app container, which gets it plus its
/// switch sibling: GPA with a real must_include.
pub fn init_efa_reused_with_its_sibling(t: &mut Topology) -> Result<Detail> {
    t.fresh(SINGLE_NUMA_NODE, Host::P5en)?;
    t.expect_running(
        "t10",
        &[Container::init("setup", 1, 0), Container::app("job", 2, 0)],
    )?;
    let kept = t.ids_of("t10", RESOURCE, Some("setup"));
    let app = t.ids_of("t10", RESOURCE, Some("job"));
    let switch = |i: usize| app.get(i).map(|id| t.switch_of(id)).unwrap_or_default();
    let reused = !kept.is_empty()
        && kept.iter().all(|id| app.contains(id))
        && app.len() >= 2
        && switch(0) == switch(1);
    ensure(reused, || {
        format!(
            "init got [{}], app [{}] (switches {} {}): want the init's EFA and its switch sibling; {}",
            spaced(&kept),
            spaced(&app),
            switch(0),
            switch(1),
            t.gpa_summary()
        )
    })?;
    let last = t.new_gpa().pop().map(|gpa| gpa.must).unwrap_or_default();
    ensure(super::observe::sorted_ids(&last) == kept, || {
        format!(
            "the app container's GPA had must_include [{last}], want [{}]; {}",
            spaced(&kept),
            t.gpa_summary()
        )
    })?;
    Ok(format!(
        "init [{}], app [{}] behind {}; {}",
        spaced(&kept),
        spaced(&app),
        switch(0),
        t.gpa_summary()
    ))
}

/// T11: the static CPU manager with CPU 0 reserved: a Guaranteed pod's one exclusive CPU can
/// only be CPU 1, on node 1, so single-numa-node offers GPA node 1's EFAs alone, and the
/// container runs on CPU 1.
pub fn static_cpu_manager_picks_node_1(t: &mut Topology) -> Result<Detail> {
    let policy = Policy {
        static_cpus: true,
        ..SINGLE_NUMA_NODE
    };
    t.fresh(policy, Host::P4d)?;
    t.expect_running("t11", &[Container::app("job", 1, 0).with_cpus(1)])?;
    let answer = expect_one_gpa(t, &t.ids(Host::P4d, Some(1)), 1)?;
    expect_devices(t, "t11", RESOURCE, Some("job"), Some(&answer), "1")?;
    let cpus = t.cpus_of("t11", "job");
    ensure(cpus == "1", || {
        format!("container job runs on CPUs [{cpus}], want [1]")
    })?;
    Ok(format!(
        "CPU {cpus} + [{}] (key 1); hints [{}]; {}",
        spaced(&answer),
        t.hints_of("t11", RESOURCE),
        t.gpa_summary()
    ))
}
