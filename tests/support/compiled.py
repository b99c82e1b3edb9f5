"""What XLA compiles in a traced step."""


def xla_compiled_nodes(function, *args) -> set:
    """(op type, node name) of every node inside the functions that XLA must compile
    (`_XlaMustCompile`, the mark of tf.function(jit_compile=True)) in the graph `function` (a
    tf.function) traces for `args`."""
    library = function.get_concrete_function(*args).graph.as_graph_def().library.function
    return {(node.op, node.name) for f in library if f.attr["_XlaMustCompile"].b for node in f.node_def}


def xla_compiled_ops(function, *args) -> set:
    """The op types of xla_compiled_nodes."""
    return {op for op, _ in xla_compiled_nodes(function, *args)}
