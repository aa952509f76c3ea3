//! The kubelet's PodResources answer, read as bytes and checked before it is decoded.
//!
//! prost's generated types cost far more than the wire: each message decodes to a struct of
//! several `Vec` and `String` headers, and each non-empty one to allocations of its own, about
//! 75 times the bytes for tiny pods. [`super::MAX_ANSWER`] bounds the bytes, not what they hold:
//! a 4 MiB answer of 77,000 tiny pods decoded to 114 MiB, a container listing 1.4 million
//! one-character IDs would to about 78 MiB, against the pod's 64 MiB limit. So the answer is
//! read as bytes ([`Raw`]), walked once without allocating to count every element prost would
//! decode into a value of its own and the memory they would take ([`check`]), and refused, as a
//! failed poll, when it lists more of any kind than a node holds or would take more than
//! [`MOST_DECODED`]. Only then is it decoded.

use prost::Message;
use prost::bytes::{Buf, Bytes};
use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic_prost::ProstEncoder;

use crate::proto::podresources::{
    CdiDevice, ClaimResource, ContainerDevices, ContainerMemory, ContainerResources,
    DynamicResource, ListPodResourcesRequest, ListPodResourcesResponse, NumaNode, PodResources,
};

/// The PodResources `List` call's codec: the request encoded by prost, the answer kept as the
/// bytes it came in, so that it is checked before anything is decoded from it.
#[derive(Default)]
pub(crate) struct Raw;

impl Codec for Raw {
    type Encode = ListPodResourcesRequest;
    type Decode = Bytes;
    type Encoder = ProstEncoder<ListPodResourcesRequest>;
    type Decoder = RawDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(BufferSettings::default())
    }

    fn decoder(&mut self) -> Self::Decoder {
        RawDecoder
    }
}

/// Yields each message's bytes as they are: a view of tonic's receive buffer, not a copy.
pub(crate) struct RawDecoder;

impl Decoder for RawDecoder {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

/// The answer in `bytes`, decoded once [`check`] has found nothing in it a node does not hold.
/// A decoding error reads as tonic's decoder gave it.
pub(crate) fn decode(bytes: Bytes) -> Result<ListPodResourcesResponse, String> {
    check(&bytes)?;
    ListPodResourcesResponse::decode(bytes).map_err(|err| format!("List: {err}"))
}

/// Each kind of element prost decodes into a value of its own, by the field that lists it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// `ListPodResourcesResponse.pod_resources`.
    Pod,
    /// `PodResources.containers`.
    Container,
    /// `ContainerResources.devices`.
    DeviceGroup,
    /// `ContainerDevices.device_ids`.
    DeviceId,
    /// `TopologyInfo.nodes`, of a device group or a memory block.
    NumaNode,
    /// `cpu_ids` of a pod or a container, packed or not.
    CpuId,
    /// `memory` of a pod or a container.
    MemoryBlock,
    /// `ContainerResources.dynamic_resources`.
    Claim,
    /// `DynamicResource.claim_resources`.
    ClaimDevice,
    /// `ClaimResource.cdi_devices`.
    CdiDevice,
}

/// The most pods a node's answer lists. `List` lists the pods the kubelet runs, at most its
/// `maxPods`: 110 by default, Kubernetes' tested limit, and at most 737 in EKS's max-pods
/// calculator. Over five times that.
const MOST_PODS: usize = 4096;

/// The most containers: a pod's app containers and its sidecars (restartable init
/// containers), 4 a pod at [`MOST_PODS`] and 22 at EKS's 737.
const MOST_CONTAINERS: usize = 16_384;

/// The most device IDs: the largest legitimate answer has every ID advertised held. Start-up
/// accepts sharing up to a device list the kubelet can read in one 4 MiB message, 1,780 EFAs ×
/// 64 replicas = 113,920 IDs of this resource; the rest is for other resources' (GPUs,
/// Neuron cores and the like: a few hundred on a node).
const MOST_DEVICE_IDS: usize = 131_072;

/// The most device groups: the kubelet lists each held device ID in a group of its own, once
/// per NUMA node of the device (`containerDevicesFromResourceDeviceInstances`), and a PCI
/// device sits on one node.
const MOST_DEVICE_GROUPS: usize = MOST_DEVICE_IDS;

/// The most CPU IDs: exclusive CPUs, each listed in the container that holds it and again at
/// its pod's level, on EC2's largest instances' 896 vCPUs. About 18 listings a CPU.
const MOST_CPU_IDS: usize = 16_384;

/// The most memory blocks: the memory manager lists one per memory type (memory and each
/// hugepage size) a container, and its pod's, holds: a few at every container.
const MOST_MEMORY_BLOCKS: usize = 16_384;

/// The most NUMA nodes listed: one for each device group (see [`MOST_DEVICE_GROUPS`]), and
/// each memory block's, at most the node's NUMA nodes (8, generously, on EC2).
const MOST_NUMA_NODES: usize = MOST_DEVICE_GROUPS + 8 * MOST_MEMORY_BLOCKS;

/// The most DRA claims, claim devices and CDI devices, each: a container names the claims it
/// uses, a claim its allocated devices (at most 32 a claim), a device its CDI names (one or
/// two). A node holds a few hundred DRA devices at most.
const MOST_DRA: usize = 16_384;

impl Kind {
    /// What one element takes in its `Vec`, as prost's generated types hold it.
    const fn size(self) -> usize {
        match self {
            Kind::Pod => size_of::<PodResources>(),
            Kind::Container => size_of::<ContainerResources>(),
            Kind::DeviceGroup => size_of::<ContainerDevices>(),
            Kind::DeviceId => size_of::<String>(),
            Kind::NumaNode => size_of::<NumaNode>(),
            Kind::CpuId => size_of::<i64>(),
            Kind::MemoryBlock => size_of::<ContainerMemory>(),
            Kind::Claim => size_of::<DynamicResource>(),
            Kind::ClaimDevice => size_of::<ClaimResource>(),
            Kind::CdiDevice => size_of::<CdiDevice>(),
        }
    }

    const ALL: [Kind; 10] = [
        Kind::Pod,
        Kind::Container,
        Kind::DeviceGroup,
        Kind::DeviceId,
        Kind::NumaNode,
        Kind::CpuId,
        Kind::MemoryBlock,
        Kind::Claim,
        Kind::ClaimDevice,
        Kind::CdiDevice,
    ];

    /// What the refusal calls this kind, the most an answer may list, and who would hold them.
    fn bound(self) -> (&'static str, usize, &'static str) {
        match self {
            Kind::Pod => ("pods", MOST_PODS, "a node runs"),
            Kind::Container => ("containers", MOST_CONTAINERS, "a node's pods run"),
            Kind::DeviceGroup => (
                "device groups",
                MOST_DEVICE_GROUPS,
                "a node's held devices make",
            ),
            Kind::DeviceId => ("device IDs", MOST_DEVICE_IDS, "a node advertises"),
            Kind::NumaNode => (
                "NUMA nodes",
                MOST_NUMA_NODES,
                "a node's devices and memory name",
            ),
            Kind::CpuId => ("CPU IDs", MOST_CPU_IDS, "a node's exclusive CPUs make"),
            Kind::MemoryBlock => (
                "memory blocks",
                MOST_MEMORY_BLOCKS,
                "a node's containers hold",
            ),
            Kind::Claim => ("DRA claims", MOST_DRA, "a node's containers use"),
            Kind::ClaimDevice => ("DRA claim devices", MOST_DRA, "a node's claims hold"),
            Kind::CdiDevice => ("CDI devices", MOST_DRA, "a node's claims name"),
        }
    }
}

/// How many elements of each kind an answer lists, in the order of [`Kind::ALL`], and about how
/// many bytes prost's types take for them.
#[derive(Debug, Default)]
struct Tally {
    listed: [usize; Kind::ALL.len()],
    decoded: usize,
}

impl Tally {
    fn of(&self, kind: Kind) -> usize {
        self.listed[kind as usize]
    }

    /// Counts `n` of `kind`, the elements of one repeated field of one message: prost pushes
    /// them one at a time into a `Vec` whose capacity doubles from 4 (`RawVec`'s least for
    /// elements this small).
    fn add(&mut self, kind: Kind, n: usize) {
        self.listed[kind as usize] += n;
        if n > 0 {
            let capacity = n.next_power_of_two().max(4);
            self.decoded += allocation(kind.size().saturating_mul(capacity));
        }
    }

    /// Counts a string of `len` bytes, an allocation of its own unless empty.
    fn add_text(&mut self, len: usize) {
        if len > 0 {
            self.decoded += allocation(len);
        }
    }
}

/// What glibc's malloc, which the shipped static binary links, takes for `bytes`: an 8-byte
/// header, 16-byte alignment, 32 bytes at least.
fn allocation(bytes: usize) -> usize {
    bytes.saturating_add(8).next_multiple_of(16).max(32)
}

/// The most memory prost's types may take for one answer, as the walk reckons it (checked
/// against a counting allocator: within 32 bytes of what glibc's malloc hands out). The
/// start-up budget gives the whole PodResources view 160 bytes per advertised ID
/// ([`super::PEAK_BYTES_PER_ID`]), 17.4 MiB at the largest sharing it accepts. Listed a
/// container at a time, those 113,920 IDs take 6.5 MiB decoded. The kubelet lists each held ID
/// as a device group of its own with its NUMA node, about 320 bytes decoded, so past about
/// 50,000 held IDs its answer is refused rather than risk the pod's limit (a p5 shared 64
/// ways has 2,048 IDs). The plugin reading an answer just within it peaks at 34 MiB (`VmHWM`,
/// debug build, `tests/memory.rs`).
const MOST_DECODED: usize = 16 << 20;

/// Refuses an answer that lists more of any kind of element than a node holds, that would take
/// more than [`MOST_DECODED`] once decoded, or that is not a well-formed
/// `ListPodResourcesResponse`, with a reason that names the count and the bound. Reads
/// `answer` once and allocates nothing per element.
fn check(answer: &[u8]) -> Result<(), String> {
    let tally = count(answer).map_err(|malformed| malformed.to_string())?;
    for kind in Kind::ALL {
        let (name, most, holders) = kind.bound();
        let listed = tally.of(kind);
        if listed > most {
            return Err(format!(
                "the answer lists {listed} {name}, more than the {most} {holders}"
            ));
        }
    }
    if tally.decoded > MOST_DECODED {
        let mib = |bytes: usize| bytes as f64 / f64::from(1 << 20);
        return Err(format!(
            "the answer would take {:.1} MiB once decoded, more than the {:.1} MiB it may",
            mib(tally.decoded),
            mib(MOST_DECODED)
        ));
    }
    Ok(())
}

/// Why the wire walk stopped, and where.
#[derive(Debug, PartialEq, Eq)]
struct Malformed {
    at: usize,
    what: &'static str,
}

impl std::fmt::Display for Malformed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the answer is not a well-formed ListPodResourcesResponse: {} at byte {}",
            self.what, self.at
        )
    }
}

/// What a field of a message holds, as prost decodes it: `Some(kind)` when it is repeated, each
/// element a value of its own in the field's `Vec`.
#[derive(Clone, Copy)]
enum Field {
    /// A message, walked by its own fields.
    Message(Option<Kind>, Schema),
    /// A string.
    Text(Option<Kind>),
    /// An integer; repeated, it may come packed.
    Integer(Option<Kind>),
}

impl Field {
    /// The kind each element is, for a repeated field.
    fn kind(self) -> Option<Kind> {
        match self {
            Field::Message(kind, _) | Field::Text(kind) | Field::Integer(kind) => kind,
        }
    }
}

/// A message's fields by number; fields not named are skipped, as prost skips them.
type Schema = &'static [(u64, Field)];

/// The most fields a schema names: the walk counts each one's elements in a message.
const MOST_FIELDS: usize = 5;

const _: () = {
    let schemas = [
        NUMA_NODE,
        TOPOLOGY,
        DEVICE_GROUP,
        MEMORY_BLOCK,
        CDI_DEVICE,
        CLAIM_DEVICE,
        CLAIM,
        CONTAINER,
        POD,
        RESPONSE,
    ];
    let mut at = 0;
    while at < schemas.len() {
        assert!(schemas[at].len() <= MOST_FIELDS);
        at += 1;
    }
};

// The messages of proto/podresources/v1/api.proto that `ListPodResourcesResponse` holds, field
// by field; the tests hold them to the generated types (`tally_of_decoded`).
const NUMA_NODE: Schema = &[(1, Field::Integer(None))];
const TOPOLOGY: Schema = &[(1, Field::Message(Some(Kind::NumaNode), NUMA_NODE))];
const DEVICE_GROUP: Schema = &[
    (1, Field::Text(None)),
    (2, Field::Text(Some(Kind::DeviceId))),
    (3, Field::Message(None, TOPOLOGY)),
];
const MEMORY_BLOCK: Schema = &[
    (1, Field::Text(None)),
    (2, Field::Integer(None)),
    (3, Field::Message(None, TOPOLOGY)),
];
const CDI_DEVICE: Schema = &[(1, Field::Text(None))];
const CLAIM_DEVICE: Schema = &[
    (1, Field::Message(Some(Kind::CdiDevice), CDI_DEVICE)),
    (2, Field::Text(None)),
    (3, Field::Text(None)),
    (4, Field::Text(None)),
    (5, Field::Text(None)),
];
const CLAIM: Schema = &[
    (2, Field::Text(None)),
    (3, Field::Text(None)),
    (4, Field::Message(Some(Kind::ClaimDevice), CLAIM_DEVICE)),
];
const CONTAINER: Schema = &[
    (1, Field::Text(None)),
    (2, Field::Message(Some(Kind::DeviceGroup), DEVICE_GROUP)),
    (3, Field::Integer(Some(Kind::CpuId))),
    (4, Field::Message(Some(Kind::MemoryBlock), MEMORY_BLOCK)),
    (5, Field::Message(Some(Kind::Claim), CLAIM)),
];
const POD: Schema = &[
    (1, Field::Text(None)),
    (2, Field::Text(None)),
    (3, Field::Message(Some(Kind::Container), CONTAINER)),
    (4, Field::Integer(Some(Kind::CpuId))),
    (5, Field::Message(Some(Kind::MemoryBlock), MEMORY_BLOCK)),
];
const RESPONSE: Schema = &[(1, Field::Message(Some(Kind::Pod), POD))];

// Protobuf's wire types.
const VARINT: u64 = 0;
const FIXED64: u64 = 1;
const LENGTH_DELIMITED: u64 = 2;
const FIXED32: u64 = 5;

/// Counts what `answer` lists of each kind, or says where it is not well formed.
fn count(answer: &[u8]) -> Result<Tally, Malformed> {
    let mut tally = Tally::default();
    Cursor {
        bytes: answer,
        at: 0,
    }
    .walk(answer.len(), RESPONSE, &mut tally)?;
    Ok(tally)
}

/// A position in the answer. Each message is walked up to its own end, so the walk's depth is
/// the schema's, whatever the bytes say.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn malformed(&self, what: &'static str) -> Malformed {
        Malformed { at: self.at, what }
    }

    /// A field that cannot be read as its key says, named at its key.
    fn malformed_field(key_at: usize, what: &'static str) -> Malformed {
        Malformed { at: key_at, what }
    }

    /// Walks the fields of one message of `schema` that ends at `end`.
    fn walk(&mut self, end: usize, schema: Schema, tally: &mut Tally) -> Result<(), Malformed> {
        // The elements of each of this message's repeated fields, by the field's place in
        // `schema`, for the `Vec` each fills.
        let mut elements = [0; MOST_FIELDS];
        while self.at < end {
            let key_at = self.at;
            let key = self.varint(end)?;
            if key > u64::from(u32::MAX) || key >> 3 == 0 {
                return Err(Self::malformed_field(key_at, "an invalid field key"));
            }
            let (number, wire) = (key >> 3, key & 7);
            let field = schema.iter().position(|(n, _)| *n == number);
            // How many elements of its field this occurrence adds.
            let added = match (field.map(|at| schema[at].1), wire) {
                (Some(Field::Message(_, inner)), LENGTH_DELIMITED) => {
                    let inner_end = self.length(end)?;
                    self.walk(inner_end, inner, tally)?;
                    1
                }
                (Some(Field::Text(_)), LENGTH_DELIMITED) => {
                    let text_end = self.length(end)?;
                    tally.add_text(text_end - self.at);
                    self.at = text_end;
                    1
                }
                (Some(Field::Integer(_)), VARINT) => {
                    self.varint(end)?;
                    1
                }
                (Some(Field::Integer(Some(_))), LENGTH_DELIMITED) => {
                    let packed_end = self.length(end)?;
                    let mut packed = 0;
                    while self.at < packed_end {
                        self.varint(packed_end)?;
                        packed += 1;
                    }
                    packed
                }
                (Some(_), _) => {
                    return Err(Self::malformed_field(
                        key_at,
                        "a field of the wrong wire type",
                    ));
                }
                (None, VARINT) => {
                    self.varint(end)?;
                    0
                }
                (None, FIXED64) => {
                    self.at = self.skip(8, end)?;
                    0
                }
                (None, LENGTH_DELIMITED) => {
                    self.at = self.length(end)?;
                    0
                }
                (None, FIXED32) => {
                    self.at = self.skip(4, end)?;
                    0
                }
                // Groups (3, 4) are not proto3's, and 6 and 7 are no wire type at all.
                (None, _) => {
                    return Err(Self::malformed_field(
                        key_at,
                        "a group or an invalid wire type",
                    ));
                }
            };
            if let Some(at) = field {
                elements[at] += added;
            }
        }
        for ((_, field), n) in schema.iter().zip(elements) {
            if let Some(kind) = field.kind() {
                tally.add(kind, n);
            }
        }
        Ok(())
    }

    /// Reads a varint that ends before `end`, refusing one over 64 bits as prost does.
    fn varint(&mut self, end: usize) -> Result<u64, Malformed> {
        let mut value = 0;
        for shift in (0..70).step_by(7) {
            let Some(&byte) = self.bytes[..end].get(self.at) else {
                return Err(self.malformed("a varint cut short"));
            };
            if shift == 63 && byte > 1 {
                return Err(self.malformed("a varint over 64 bits"));
            }
            self.at += 1;
            value |= u64::from(byte & 0x7f) << shift;
            if byte < 0x80 {
                return Ok(value);
            }
        }
        Err(self.malformed("a varint over 64 bits"))
    }

    /// Reads a length prefix; the end of what it delimits, within `end`.
    fn length(&mut self, end: usize) -> Result<usize, Malformed> {
        let len = self.varint(end)?;
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        self.skip(len, end)
    }

    /// The position `len` bytes on, within `end`.
    fn skip(&self, len: usize, end: usize) -> Result<usize, Malformed> {
        match self.at.checked_add(len) {
            Some(after) if after <= end => Ok(after),
            _ => Err(self.malformed("a field longer than what holds it")),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::collection::vec;
    use proptest::prelude::*;

    use super::*;
    use crate::proto::podresources::{
        CdiDevice, ClaimResource, ContainerDevices, ContainerMemory, ContainerResources,
        DynamicResource, NumaNode, PodResources, TopologyInfo,
    };

    /// How many of each kind, in the order of [`Kind::ALL`].
    type Listed = [usize; Kind::ALL.len()];

    /// What prost decoded, counted from the generated types. Each struct is taken apart with no
    /// `..`, so a field added to the proto does not compile here until the walk's schema and
    /// this count both say what it holds.
    fn tally_of_decoded(response: &ListPodResourcesResponse) -> Listed {
        fn add(tally: &mut Listed, kind: Kind, n: usize) {
            tally[kind as usize] += n;
        }
        fn topology(tally: &mut Listed, topology: &Option<TopologyInfo>) {
            if let Some(TopologyInfo { nodes }) = topology {
                for NumaNode { id: _ } in nodes {
                    add(tally, Kind::NumaNode, 1);
                }
            }
        }
        fn memory(tally: &mut Listed, blocks: &[ContainerMemory]) {
            for block in blocks {
                let ContainerMemory {
                    memory_type: _,
                    size: _,
                    topology: numa,
                } = block;
                add(tally, Kind::MemoryBlock, 1);
                topology(tally, numa);
            }
        }
        let mut tally = Listed::default();
        let ListPodResourcesResponse { pod_resources } = response;
        for pod in pod_resources {
            let PodResources {
                name: _,
                namespace: _,
                containers,
                cpu_ids,
                memory: pod_memory,
            } = pod;
            add(&mut tally, Kind::Pod, 1);
            add(&mut tally, Kind::CpuId, cpu_ids.len());
            memory(&mut tally, pod_memory);
            for container in containers {
                let ContainerResources {
                    name: _,
                    devices,
                    cpu_ids,
                    memory: container_memory,
                    dynamic_resources,
                } = container;
                add(&mut tally, Kind::Container, 1);
                add(&mut tally, Kind::CpuId, cpu_ids.len());
                memory(&mut tally, container_memory);
                for group in devices {
                    let ContainerDevices {
                        resource_name: _,
                        device_ids,
                        topology: numa,
                    } = group;
                    add(&mut tally, Kind::DeviceGroup, 1);
                    add(&mut tally, Kind::DeviceId, device_ids.len());
                    topology(&mut tally, numa);
                }
                for claim in dynamic_resources {
                    let DynamicResource {
                        claim_name: _,
                        claim_namespace: _,
                        claim_resources,
                    } = claim;
                    add(&mut tally, Kind::Claim, 1);
                    for device in claim_resources {
                        let ClaimResource {
                            cdi_devices,
                            driver_name: _,
                            pool_name: _,
                            device_name: _,
                            share_id: _,
                        } = device;
                        add(&mut tally, Kind::ClaimDevice, 1);
                        for CdiDevice { name: _ } in cdi_devices {
                            add(&mut tally, Kind::CdiDevice, 1);
                        }
                    }
                }
            }
        }
        tally
    }

    fn numa(nodes: usize) -> Option<TopologyInfo> {
        Some(TopologyInfo {
            nodes: (0..nodes).map(|id| NumaNode { id: id as i64 }).collect(),
        })
    }

    fn block(nodes: usize) -> ContainerMemory {
        ContainerMemory {
            memory_type: "hugepages-1Gi".into(),
            size: 1 << 30,
            topology: numa(nodes),
        }
    }

    /// An answer listing `n` of `kind`, and one of each element that holds them.
    fn listing(kind: Kind, n: usize) -> ListPodResourcesResponse {
        let cdi = |n| vec![CdiDevice::default(); n];
        let claim_device = |cdi_devices| ClaimResource {
            cdi_devices,
            ..Default::default()
        };
        let claim = |claim_resources| DynamicResource {
            claim_resources,
            ..Default::default()
        };
        let group = |device_ids, topology| ContainerDevices {
            resource_name: "vpc.amazonaws.com/efa".into(),
            device_ids,
            topology,
        };
        let mut container = ContainerResources::default();
        match kind {
            Kind::Pod => {
                return ListPodResourcesResponse {
                    pod_resources: vec![PodResources::default(); n],
                };
            }
            Kind::Container => {}
            Kind::DeviceGroup => container.devices = vec![group(Vec::new(), None); n],
            Kind::DeviceId => container.devices = vec![group(vec![String::new(); n], None)],
            Kind::NumaNode => container.devices = vec![group(Vec::new(), numa(n))],
            Kind::CpuId => container.cpu_ids = vec![1; n],
            Kind::MemoryBlock => container.memory = vec![block(0); n],
            Kind::Claim => container.dynamic_resources = vec![claim(Vec::new()); n],
            Kind::ClaimDevice => {
                container.dynamic_resources = vec![claim(vec![claim_device(Vec::new()); n])]
            }
            Kind::CdiDevice => {
                container.dynamic_resources = vec![claim(vec![claim_device(cdi(n))])]
            }
        }
        let containers = if kind == Kind::Container { n } else { 1 };
        ListPodResourcesResponse {
            pod_resources: vec![PodResources {
                containers: vec![container; containers],
                ..Default::default()
            }],
        }
    }

    #[test]
    fn the_walk_counts_each_element_prost_decodes_into_a_value() {
        let container = ContainerResources {
            name: "main".into(),
            devices: vec![
                ContainerDevices {
                    resource_name: "vpc.amazonaws.com/efa".into(),
                    device_ids: vec!["rdmap16s27::0".into(), "rdmap16s27::1".into()],
                    topology: numa(1),
                },
                ContainerDevices {
                    resource_name: "nvidia.com/gpu".into(),
                    device_ids: vec!["GPU-0".into(), "GPU-1".into(), "GPU-2".into()],
                    topology: numa(2),
                },
            ],
            cpu_ids: vec![2, 3, 130, -1],
            memory: vec![block(1), block(2)],
            dynamic_resources: vec![DynamicResource {
                claim_name: "gpus".into(),
                claim_namespace: "ml".into(),
                claim_resources: vec![ClaimResource {
                    cdi_devices: vec![
                        CdiDevice {
                            name: "vendor.com/gpu=0".into(),
                        };
                        2
                    ],
                    driver_name: "gpu.example.com".into(),
                    pool_name: "node-1".into(),
                    device_name: "gpu-0".into(),
                    share_id: Some("a".into()),
                }],
            }],
        };
        let response = ListPodResourcesResponse {
            pod_resources: vec![
                PodResources {
                    name: "trainer-0".into(),
                    namespace: "ml".into(),
                    containers: vec![container.clone(), ContainerResources::default()],
                    cpu_ids: vec![2, 3],
                    memory: vec![block(3)],
                },
                PodResources::default(),
            ],
        };
        let counted = count(&response.encode_to_vec()).unwrap().listed;
        // Pods, containers, groups, IDs, NUMA nodes (1 + 2 of the groups, 1 + 2 + 3 of the
        // memory blocks), CPUs, memory blocks, claims, claim devices, CDI devices.
        assert_eq!(counted, [2, 2, 2, 5, 9, 6, 3, 1, 1, 2]);
        assert_eq!(counted, tally_of_decoded(&response));
    }

    #[test]
    fn cpu_ids_count_packed_or_one_by_one_as_prost_takes_both() {
        let packed = ContainerResources {
            cpu_ids: vec![1, 2, 300],
            ..Default::default()
        };
        let mut container = packed.encode_to_vec();
        // Field 3, varint: two CPU IDs listed one by one.
        container.extend([3 << 3, 7, 3 << 3, 0x80, 0x01]);
        let mut pod = vec![3 << 3 | 2, container.len() as u8];
        pod.extend(&container);
        let mut answer = vec![1 << 3 | 2, pod.len() as u8];
        answer.extend(&pod);
        let decoded = ListPodResourcesResponse::decode(answer.as_slice()).unwrap();
        assert_eq!(decoded.pod_resources[0].containers[0].cpu_ids.len(), 5);
        assert_eq!(count(&answer).unwrap().listed, tally_of_decoded(&decoded));
    }

    #[test]
    fn each_bound_accepts_an_answer_at_it_and_refuses_one_past_it() {
        for kind in Kind::ALL {
            let (name, most, holders) = kind.bound();
            let at = listing(kind, most).encode_to_vec();
            assert_eq!(count(&at).unwrap().of(kind), most, "{name}");
            assert_eq!(check(&at), Ok(()), "{name}");
            let past = listing(kind, most + 1).encode_to_vec();
            assert_eq!(
                check(&past).unwrap_err(),
                format!(
                    "the answer lists {} {name}, more than the {most} {holders}",
                    most + 1
                )
            );
        }
    }

    /// Pods of 100 device IDs each, as the kubelet lists them: a group of its own per ID, with
    /// its NUMA node.
    fn held_as_the_kubelet_lists(pods: usize) -> ListPodResourcesResponse {
        let group = |id: usize| ContainerDevices {
            resource_name: "vpc.amazonaws.com/efa".into(),
            device_ids: vec![format!("rdmap{}s27::{}", id % 100, id % 64)],
            topology: numa(1),
        };
        let pod = |pod: usize| PodResources {
            name: format!("pod-{pod}"),
            namespace: "ml".into(),
            containers: vec![ContainerResources {
                name: "main".into(),
                devices: (0..100).map(|id| group(pod * 100 + id)).collect(),
                ..Default::default()
            }],
            ..Default::default()
        };
        ListPodResourcesResponse {
            pod_resources: (0..pods).map(pod).collect(),
        }
    }

    #[test]
    fn an_answer_within_every_count_is_refused_past_the_memory_it_would_take() {
        assert_eq!(
            check(&held_as_the_kubelet_lists(500).encode_to_vec()),
            Ok(())
        );
        let answer = held_as_the_kubelet_lists(520).encode_to_vec();
        assert!(answer.len() < 3 << 20, "{} bytes", answer.len());
        let per_id = count(&answer).unwrap().decoded / 52_000;
        assert!((300..350).contains(&per_id), "{per_id} bytes per held ID");
        let refused = check(&answer).unwrap_err();
        assert!(
            refused.starts_with("the answer would take 16.")
                && refused.ends_with(" MiB once decoded, more than the 16.0 MiB it may"),
            "{refused}"
        );
    }

    #[test]
    fn a_flood_of_tiny_pods_is_refused_by_its_count() {
        let answer = listing(Kind::Pod, 77_000).encode_to_vec();
        assert_eq!(
            check(&answer).unwrap_err(),
            "the answer lists 77000 pods, more than the 4096 a node runs"
        );
    }

    #[test]
    fn a_cut_answer_is_refused_or_shorter_never_a_panic() {
        let answer = listing(Kind::DeviceId, 3).encode_to_vec();
        for end in 0..answer.len() {
            let cut = &answer[..end];
            match (count(cut), ListPodResourcesResponse::decode(cut)) {
                (Ok(counted), Ok(decoded)) => {
                    assert_eq!(counted.listed, tally_of_decoded(&decoded))
                }
                (Err(malformed), Err(_)) => assert!(malformed.at <= end, "{malformed}"),
                (walked, decoded) => panic!("cut at {end}: {walked:?} but {decoded:?}"),
            }
        }
    }

    #[test]
    fn malformed_answers_are_refused_naming_what_and_where() {
        let cases: [(&[u8], &str); 7] = [
            // A pod 100 bytes long in an answer of 3.
            (
                &[0x0a, 100, 0],
                "a field longer than what holds it at byte 2",
            ),
            // An unknown field's varint whose tenth byte holds more than the 64th bit.
            (
                &[
                    0x10, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02,
                ],
                "a varint over 64 bits at byte 10",
            ),
            (&[0x10, 0x80], "a varint cut short at byte 2"),
            // Field 0.
            (&[0x02, 0x00], "an invalid field key at byte 0"),
            // The pods as a varint, after one pod.
            (
                &[0x0a, 0x00, 0x08, 0x01],
                "a field of the wrong wire type at byte 2",
            ),
            // An unknown field as a group, and as wire type 7.
            (&[0x13, 0x14], "a group or an invalid wire type at byte 0"),
            (&[0x17], "a group or an invalid wire type at byte 0"),
        ];
        for (answer, says) in cases {
            let refused = check(answer).unwrap_err();
            assert!(
                refused.starts_with("the answer is not a well-formed ListPodResourcesResponse: "),
                "{refused}"
            );
            assert!(refused.ends_with(says), "{answer:?}: {refused}");
        }
        // A pod's ID inside a message that ends first, as prost refuses it too.
        let inner = [0x0a, 0x02, 0x1a, 0x05, 0, 0, 0, 0, 0];
        assert!(ListPodResourcesResponse::decode(&inner[..]).is_err());
        assert!(
            check(&inner)
                .unwrap_err()
                .ends_with("a field longer than what holds it at byte 4")
        );
    }

    #[test]
    fn unknown_fields_are_skipped_as_prost_skips_them() {
        let mut answer = listing(Kind::Pod, 2).encode_to_vec();
        // Field 9 of each wire type prost skips: varint, 64-bit, bytes, 32-bit.
        answer.extend([9 << 3, 0x96, 0x01, 9 << 3 | 1, 0, 0, 0, 0, 0, 0, 0, 0]);
        answer.extend([9 << 3 | 2, 2, 0x0a, 0x00, 9 << 3 | 5, 0, 0, 0, 0]);
        let decoded = ListPodResourcesResponse::decode(answer.as_slice()).unwrap();
        assert_eq!(count(&answer).unwrap().listed, tally_of_decoded(&decoded));
        assert_eq!(count(&answer).unwrap().of(Kind::Pod), 2);
    }

    fn topology() -> impl Strategy<Value = Option<TopologyInfo>> {
        proptest::option::of(
            vec(any::<i64>().prop_map(|id| NumaNode { id }), 0..3)
                .prop_map(|nodes| TopologyInfo { nodes }),
        )
    }

    fn memory() -> impl Strategy<Value = Vec<ContainerMemory>> {
        let block =
            ("[a-z]{0,3}", any::<u64>(), topology()).prop_map(|(memory_type, size, topology)| {
                ContainerMemory {
                    memory_type,
                    size,
                    topology,
                }
            });
        vec(block, 0..3)
    }

    fn claims() -> impl Strategy<Value = Vec<DynamicResource>> {
        let cdi = vec("[a-z=]{0,3}".prop_map(|name| CdiDevice { name }), 0..3);
        let device =
            (cdi, proptest::option::of("[a-z]{0,2}")).prop_map(|(cdi_devices, share_id)| {
                ClaimResource {
                    cdi_devices,
                    device_name: "d".into(),
                    share_id,
                    ..Default::default()
                }
            });
        let claim = ("[a-z]{0,3}", vec(device, 0..3)).prop_map(|(claim_name, claim_resources)| {
            DynamicResource {
                claim_name,
                claim_resources,
                ..Default::default()
            }
        });
        vec(claim, 0..3)
    }

    fn containers() -> impl Strategy<Value = Vec<ContainerResources>> {
        let group = ("[a-z/.]{0,4}", vec("[a-z0-9:]{0,4}", 0..4), topology()).prop_map(
            |(resource_name, device_ids, topology)| ContainerDevices {
                resource_name,
                device_ids,
                topology,
            },
        );
        let container = (
            "[a-z]{0,3}",
            vec(group, 0..3),
            vec(any::<i64>(), 0..4),
            memory(),
            claims(),
        )
            .prop_map(|(name, devices, cpu_ids, memory, dynamic_resources)| {
                ContainerResources {
                    name,
                    devices,
                    cpu_ids,
                    memory,
                    dynamic_resources,
                }
            });
        vec(container, 0..3)
    }

    fn answers() -> impl Strategy<Value = ListPodResourcesResponse> {
        let pod = (
            "[a-z]{0,3}",
            containers(),
            vec(any::<i64>(), 0..3),
            memory(),
        )
            .prop_map(|(name, containers, cpu_ids, memory)| PodResources {
                name,
                namespace: "ml".into(),
                containers,
                cpu_ids,
                memory,
            });
        vec(pod, 0..4).prop_map(|pod_resources| ListPodResourcesResponse { pod_resources })
    }

    proptest! {
        #[test]
        fn the_walk_counts_what_prost_decodes(answer in answers()) {
            let encoded = answer.encode_to_vec();
            prop_assert_eq!(count(&encoded).map(|t| t.listed), Ok(tally_of_decoded(&answer)));
        }

        /// Whatever the bytes, the walk ends without a panic, and where prost decodes them, the
        /// walk counts what it decoded or names the group prost skipped.
        #[test]
        fn the_walk_never_panics_and_agrees_with_prost(
            answer in answers(),
            garble in vec((any::<proptest::sample::Index>(), any::<u8>()), 0..4),
            cut in any::<proptest::sample::Index>(),
            noise in vec(any::<u8>(), 0..64),
        ) {
            let mut bytes = answer.encode_to_vec();
            for (at, byte) in &garble {
                if !bytes.is_empty() {
                    let at = at.index(bytes.len());
                    bytes[at] = *byte;
                }
            }
            bytes.truncate(cut.index(bytes.len() + 1));
            for bytes in [bytes, noise] {
                let walked = count(&bytes);
                if let Ok(decoded) = ListPodResourcesResponse::decode(bytes.as_slice()) {
                    match walked {
                        Ok(counted) => prop_assert_eq!(counted.listed, tally_of_decoded(&decoded)),
                        Err(malformed) => prop_assert_eq!(malformed.what, "a group or an invalid wire type"),
                    }
                }
            }
        }
    }
}
