// TensorFlow ops over id_map::IdMap (id_map.h), one resource per table (shard): IdMapHandle creates
// or finds it, IdMapFindOrInsert / IdMapFind look a batch up (finds spread over the intra-op thread
// pool from kParallelFrom ids on), IdMapExport / IdMapImport read and replace its whole state,
// IdMapStats counts, IdMapDestroy drops it. CPU kernels; a GPU form would replace phase 1 (finds)
// with a kernel and keep the serial phases on the host (id_map.h).
#include "id_map.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/platform/mutex.h"
#include "tensorflow/core/util/work_sharder.h"

namespace tensorflow {
namespace {

using shape_inference::InferenceContext;
constexpr int64_t kParallelFrom = 16384;   // fewer ids: found on the calling thread
constexpr int64_t kFindCost = 200;         // a find's cost for the thread pool's partition (cycles)

class IdMapResource : public ResourceBase {
 public:
  IdMapResource(const std::string& table, int64_t capacity, int64_t admit_after, id_map::Policy policy,
                int64_t ttl, int64_t candidate_slots)
      : table(table), map(capacity, admit_after, policy, ttl, candidate_slots) {}
  std::string DebugString() const override { return "IdMap " + table; }
  const std::string table;
  mutex mu;
  id_map::IdMap map TF_GUARDED_BY(mu);
};

Status ScalarShape(InferenceContext* c) {
  c->set_output(0, c->Scalar());
  return OkStatus();
}

REGISTER_OP("IdMapHandle")
    .Attr("table: string")
    .Attr("capacity: int >= 1")
    .Attr("admit_after: int >= 1 = 1")
    .Attr("policy: {'lru', 'lfu', 'ttl'} = 'lru'")
    .Attr("ttl: int >= 0 = 0")
    .Attr("candidate_slots: int >= 0 = 0")
    .Attr("container: string = ''")
    .Attr("shared_name: string")
    .Output("handle: resource")
    .SetIsStateful()
    .SetShapeFn(ScalarShape)
    .Doc("The id map `shared_name` (created on first use): `capacity` rows, ids admitted at their "
         "`admit_after`-th sighting (candidate_slots counters, 0: capacity), eviction `policy`.");

REGISTER_OP("IdMapFindOrInsert")
    .Input("handle: resource")
    .Input("ids: int64")
    .Input("step: int64")
    .Output("rows: int32")
    .Output("codes: int32")
    .Output("evicted: int64")
    .Output("full: bool")
    .SetShapeFn([](InferenceContext* c) {
      shape_inference::ShapeHandle ids;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &ids));
      for (int i = 0; i < 3; ++i) c->set_output(i, ids);
      c->set_output(3, c->Scalar());
      return OkStatus();
    })
    .Doc("ids [n] at training step `step` -> rows [n] (-1: refused), codes [n] (0 hit, 1 admitted, "
         "2 admitted into an evicted id's row, 3 refused), evicted [n] (that id where code 2, else 0), "
         "full []: the batch has more distinct ids to admit than rows (then every row -1, every code 3, "
         "and the ids before the one that found no row admitted); the caller fails the step.");

REGISTER_OP("IdMapFind")
    .Input("handle: resource")
    .Input("ids: int64")
    .Output("rows: int32")
    .SetShapeFn([](InferenceContext* c) {
      shape_inference::ShapeHandle ids;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &ids));
      c->set_output(0, ids);
      return OkStatus();
    })
    .Doc("ids [n] -> rows [n], -1 for an id without a row. Changes nothing.");

REGISTER_OP("IdMapExport")
    .Input("handle: resource")
    .Output("ids: int64")
    .Output("rows: int32")
    .Output("counts: int64")
    .Output("last_used: int64")
    .Output("candidate_ids: int64")
    .Output("candidate_sightings: int64")
    .Output("candidate_last_seen: int64")
    .Output("totals: int64")
    .SetShapeFn([](InferenceContext* c) {
      for (int i = 0; i < 7; ++i) c->set_output(i, c->Vector(c->UnknownDim()));
      c->set_output(7, c->Vector(3));
      return OkStatus();
    })
    .Doc("The live ids [L] with their rows, counts, last-used steps in eviction order; the candidates "
         "[M] (id, sightings, last-seen step); totals [3]: admitted, evicted, refused.");

REGISTER_OP("IdMapImport")
    .Input("handle: resource")
    .Input("ids: int64")
    .Input("rows: int32")
    .Input("counts: int64")
    .Input("last_used: int64")
    .Input("candidate_ids: int64")
    .Input("candidate_sightings: int64")
    .Input("candidate_last_seen: int64")
    .Input("totals: int64")
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("Replaces the map's state with IdMapExport's outputs.");

REGISTER_OP("IdMapStats")
    .Input("handle: resource")
    .Output("stats: int64")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(6));
      return OkStatus();
    })
    .Doc("[live rows, capacity, candidates, admitted, evicted, refused] (the last three: totals).");

REGISTER_OP("IdMapDestroy").Input("handle: resource").SetShapeFn(shape_inference::NoOutputs);

class IdMapHandleOp : public OpKernel {
 public:
  explicit IdMapHandleOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string policy;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("table", &table_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("capacity", &capacity_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("admit_after", &admit_after_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("policy", &policy));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("ttl", &ttl_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("candidate_slots", &candidate_slots_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("container", &container_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("shared_name", &shared_name_));
    OP_REQUIRES(ctx, capacity_ < (int64_t{1} << 31),
                errors::InvalidArgument("dynamic table ", table_, ": capacity ", capacity_, " is over 2^31 - 1 rows"));
    policy_ = policy == "lfu" ? id_map::kLfu : policy == "ttl" ? id_map::kTtl : id_map::kLru;
    OP_REQUIRES(ctx, policy_ != id_map::kTtl || ttl_ >= 1,
                errors::InvalidArgument("dynamic table ", table_, ": policy ttl needs ttl >= 1 steps"));
    if (candidate_slots_ == 0) candidate_slots_ = capacity_;
  }

  void Compute(OpKernelContext* ctx) override {
    ResourceHandle handle = MakeResourceHandle<IdMapResource>(ctx, container_, shared_name_);
    IdMapResource* resource;
    OP_REQUIRES_OK(ctx, LookupOrCreateResource<IdMapResource>(ctx, handle, &resource, [&](IdMapResource** out) {
      *out = new IdMapResource(table_, capacity_, admit_after_, policy_, ttl_, candidate_slots_);
      return OkStatus();
    }));
    resource->Unref();
    Tensor* out;
    AllocatorAttributes host;
    host.set_on_host(true);
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out, host));
    out->scalar<ResourceHandle>()() = handle;
  }

 private:
  std::string table_, container_, shared_name_;
  int64_t capacity_, admit_after_, ttl_, candidate_slots_;
  id_map::Policy policy_;
};

// The resource of input 0, referenced while the kernel runs.
Status Map(OpKernelContext* ctx, core::RefCountPtr<IdMapResource>* out) {
  return LookupResource(ctx, HandleFromInput(ctx, 0), out);
}

id_map::ParallelFor Workers(OpKernelContext* ctx) {
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  return [workers](int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
    if (n < kParallelFrom || workers->NumThreads() <= 1) {
      fn(0, n);
    } else {
      workers->ParallelFor(n, kFindCost, fn);
    }
  };
}

Status Ids(OpKernelContext* ctx, const Tensor** ids) {
  TF_RETURN_IF_ERROR(ctx->input("ids", ids));
  if ((*ids)->dims() != 1) return errors::InvalidArgument("ids must be [n], got ", (*ids)->shape().DebugString());
  return OkStatus();
}

class IdMapFindOrInsertOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<IdMapResource> map;
    OP_REQUIRES_OK(ctx, Map(ctx, &map));
    const Tensor* ids;
    OP_REQUIRES_OK(ctx, Ids(ctx, &ids));
    const int64_t step = ctx->input(2).scalar<int64_t>()();
    Tensor *rows, *codes, *evicted, *full;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, ids->shape(), &rows));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, ids->shape(), &codes));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, ids->shape(), &evicted));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({}), &full));
    mutex_lock lock(map->mu);
    const id_map::Status status = map->map.FindOrInsert(
        ids->flat<int64_t>().data(), ids->NumElements(), step, rows->flat<int32_t>().data(),
        codes->flat<int32_t>().data(), evicted->flat<int64_t>().data(), Workers(ctx));
    full->scalar<bool>()() = status != id_map::kOk;
    if (status != id_map::kOk) {
      rows->flat<int32_t>().setConstant(-1);
      codes->flat<int32_t>().setConstant(id_map::kRefused);
      evicted->flat<int64_t>().setZero();
    }
  }
};

class IdMapFindOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<IdMapResource> map;
    OP_REQUIRES_OK(ctx, Map(ctx, &map));
    const Tensor* ids;
    OP_REQUIRES_OK(ctx, Ids(ctx, &ids));
    Tensor* rows;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, ids->shape(), &rows));
    tf_shared_lock lock(map->mu);
    map->map.Find(ids->flat<int64_t>().data(), ids->NumElements(), rows->flat<int32_t>().data(), Workers(ctx));
  }
};

template <typename T>
Status Output(OpKernelContext* ctx, int i, const std::vector<T>& values) {
  Tensor* out;
  TF_RETURN_IF_ERROR(ctx->allocate_output(i, TensorShape({static_cast<int64_t>(values.size())}), &out));
  std::copy(values.begin(), values.end(), out->flat<T>().data());
  return OkStatus();
}

class IdMapExportOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<IdMapResource> map;
    OP_REQUIRES_OK(ctx, Map(ctx, &map));
    mutex_lock lock(map->mu);   // LiveInOrder compacts the eviction order
    std::vector<int32_t> rows = map->map.LiveInOrder();
    std::vector<int64_t> ids, counts, last_used, cand_ids, sightings, last_seen;
    for (int32_t r : rows) {
      const auto& row = map->map.row(r);
      ids.push_back(row.id);
      counts.push_back(row.count);
      last_used.push_back(row.last_used);
    }
    for (const auto& c : map->map.Candidates()) {
      cand_ids.push_back(c.id);
      sightings.push_back(c.sightings);
      last_seen.push_back(c.last_seen);
    }
    const auto& t = map->map.totals();
    OP_REQUIRES_OK(ctx, Output(ctx, 0, ids));
    OP_REQUIRES_OK(ctx, Output(ctx, 1, rows));
    OP_REQUIRES_OK(ctx, Output(ctx, 2, counts));
    OP_REQUIRES_OK(ctx, Output(ctx, 3, last_used));
    OP_REQUIRES_OK(ctx, Output(ctx, 4, cand_ids));
    OP_REQUIRES_OK(ctx, Output(ctx, 5, sightings));
    OP_REQUIRES_OK(ctx, Output(ctx, 6, last_seen));
    OP_REQUIRES_OK(ctx, Output(ctx, 7, std::vector<int64_t>{t.admitted, t.evicted, t.refused}));
  }
};

class IdMapImportOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<IdMapResource> map;
    OP_REQUIRES_OK(ctx, Map(ctx, &map));
    const int64_t n = ctx->input(1).NumElements(), m = ctx->input(5).NumElements();
    for (int i = 2; i <= 4; ++i)
      OP_REQUIRES(ctx, ctx->input(i).NumElements() == n,
                  errors::InvalidArgument("dynamic table ", map->table, ": the live rows' arrays differ in length"));
    for (int i = 6; i <= 7; ++i)
      OP_REQUIRES(ctx, ctx->input(i).NumElements() == m,
                  errors::InvalidArgument("dynamic table ", map->table, ": the candidates' arrays differ in length"));
    OP_REQUIRES(ctx, ctx->input(8).NumElements() == 3,
                errors::InvalidArgument("dynamic table ", map->table, ": totals must be [3]"));
    std::vector<id_map::IdMap::Candidate> cands(m);
    for (int64_t j = 0; j < m; ++j)
      cands[j] = {ctx->input(5).flat<int64_t>()(j), ctx->input(6).flat<int64_t>()(j), ctx->input(7).flat<int64_t>()(j)};
    auto totals = ctx->input(8).flat<int64_t>();
    mutex_lock lock(map->mu);
    const std::string error = map->map.Import(
        ctx->input(1).flat<int64_t>().data(), ctx->input(2).flat<int32_t>().data(), ctx->input(3).flat<int64_t>().data(),
        ctx->input(4).flat<int64_t>().data(), n, cands.data(), m, {totals(0), totals(1), totals(2)});
    OP_REQUIRES(ctx, error.empty(), errors::InvalidArgument("dynamic table ", map->table, ": cannot restore: ", error));
  }
};

class IdMapStatsOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<IdMapResource> map;
    OP_REQUIRES_OK(ctx, Map(ctx, &map));
    tf_shared_lock lock(map->mu);
    const auto& t = map->map.totals();
    OP_REQUIRES_OK(ctx, Output(ctx, 0, std::vector<int64_t>{map->map.live(), map->map.capacity(),
                                                            map->map.candidates(), t.admitted, t.evicted, t.refused}));
  }
};

class IdMapDestroyOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    const Status status = DeleteResource(ctx, HandleFromInput(ctx, 0));
    if (!status.ok() && !errors::IsNotFound(status)) ctx->SetStatus(status);
  }
};

REGISTER_KERNEL_BUILDER(Name("IdMapHandle").Device(DEVICE_CPU), IdMapHandleOp);
REGISTER_KERNEL_BUILDER(Name("IdMapFindOrInsert").Device(DEVICE_CPU), IdMapFindOrInsertOp);
REGISTER_KERNEL_BUILDER(Name("IdMapFind").Device(DEVICE_CPU), IdMapFindOp);
REGISTER_KERNEL_BUILDER(Name("IdMapExport").Device(DEVICE_CPU), IdMapExportOp);
REGISTER_KERNEL_BUILDER(Name("IdMapImport").Device(DEVICE_CPU), IdMapImportOp);
REGISTER_KERNEL_BUILDER(Name("IdMapStats").Device(DEVICE_CPU), IdMapStatsOp);
REGISTER_KERNEL_BUILDER(Name("IdMapDestroy").Device(DEVICE_CPU), IdMapDestroyOp);

}  // namespace
}  // namespace tensorflow
