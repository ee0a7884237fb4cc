"""Expressions over ``TS`` (TensorShape) and ``Spec`` (TensorSpec), evaluated by tests/data/record_tf_tensor_shape.py
with TensorFlow's classes and by tests/test_tensor_shape.py with mirrored's: the repr of each result, or the
error it raises, must agree."""

EXPRESSIONS = [
    # construction, rank, conversion
    "TS([None, 3])", "TS(None)", "TS([])", "TS(3)", "TS('a')", "TS([1.5])", "TS([-1])", "TS((2, None))",
    "TS([2, 3]).as_list()", "TS(None).as_list()", "TS([None, 3]).as_list()", "list(TS([2, 3]))", "list(TS(None))",
    "TS([2, 3]).rank", "TS(None).rank", "TS([]).rank", "TS([2, 3]).ndims", "len(TS([2, 3]))", "len(TS(None))",
    "bool(TS([]))", "bool(TS(None))", "TS(None).dims",
    "str(TS([None, 3]))", "repr(TS([None, 3]))", "str(TS(None))", "repr(TS(None))", "repr(TS([]))", "str(TS([]))",
    "str(TS([5]))",
    # indexing
    "TS([2, 3])[0]", "TS([2, 3])[1:]", "TS([None, 3])[0]", "TS(None)[0]", "TS(None)[1:]", "TS([2, 3])[5]",
    "TS([2, 3])[-1]", "TS([2, 3])[::-1]",
    # equality and hashing
    "TS([2, 3]) == TS([2, 3])", "TS([None, 3]) == TS([None, 3])", "TS([None, 3]) != TS([None, 3])",
    "TS(None) == TS(None)", "TS(None) == TS([2])", "TS([2, 3]) == [2, 3]", "TS([2, 3]) == (2, 3)",
    "TS([2, 3]) != [2, 4]", "hash(TS([2, 3])) == hash(TS([2, 3]))",
    # sizes
    "TS([2, 3]).num_elements()", "TS([None, 3]).num_elements()", "TS(None).num_elements()", "TS([]).num_elements()",
    "TS([0, 3]).num_elements()", "TS([2, 3]).is_fully_defined()", "TS([None]).is_fully_defined()",
    "TS(None).is_fully_defined()", "TS([2, 3]).assert_is_fully_defined()", "TS([None, 3]).assert_is_fully_defined()",
    "TS(None).assert_is_fully_defined()",
    # compatibility and merging
    "TS([2, 3]).is_compatible_with(TS([None, 3]))", "TS([2, 3]).is_compatible_with(TS(None))",
    "TS([2, 3]).is_compatible_with([2, None])", "TS([2, 3]).is_compatible_with([2])",
    "TS([2, 3]).assert_is_compatible_with(TS([3, 3]))", "TS([2, 3]).assert_is_compatible_with(TS([None, 3]))",
    "TS([None, 3]).merge_with(TS([2, None]))", "TS([None, 3]).merge_with(TS([2, 4]))", "TS([2, None]).merge_with([None, 5])",
    "TS(None).merge_with(TS([1]))", "TS([2, 3]).merge_with(TS([2]))",
    "TS([2, 3]).most_specific_compatible_shape(TS([2, 4]))", "TS([2, 3]).most_specific_compatible_shape(TS([2]))",
    "TS([2, 3]).most_specific_compatible_shape(TS(None))", "TS([2, 3]).most_specific_compatible_shape([2, 3])",
    "TS([None, 3]).most_specific_compatible_shape(TS([2, 3]))",
    # ranks
    "TS([2, 3]).with_rank(2)", "TS([2, 3]).with_rank(3)", "TS(None).with_rank(2)", "TS([None, 3]).with_rank(2)",
    "TS([2, 3]).with_rank_at_least(3)", "TS([2, 3]).with_rank_at_least(1)", "TS(None).with_rank_at_least(2)",
    "TS([2, 3]).with_rank_at_most(1)", "TS([2, 3]).with_rank_at_most(2)", "TS(None).with_rank_at_most(2)",
    "TS([2, 3]).assert_has_rank(3)", "TS([2, 3]).assert_has_rank(2)", "TS(None).assert_has_rank(2)",
    "TS([2, 3]).assert_same_rank(TS([1]))", "TS([2, 3]).assert_same_rank(TS(None))", "TS([2, 3]).assert_same_rank([1, 2])",
    # trace types
    "TS([2, 3]).is_subtype_of(TS([None, 3]))", "TS([None, 3]).is_subtype_of(TS([2, 3]))",
    "TS([2, 3]).is_subtype_of(TS(None))", "TS(None).is_subtype_of(TS([2]))", "TS(None).is_subtype_of(TS(None))",
    "TS([2, 3]).is_subtype_of(TS([2, 3]))", "TS([2, 3]).is_subtype_of(TS([2]))",
    "TS([2, 3]).most_specific_common_supertype([TS([2, 4])])",
    "TS([2, 3]).most_specific_common_supertype([TS([2, 4]), TS([5, 3])])",
    "TS([2, 3]).most_specific_common_supertype([TS([2])])", "TS([2, 3]).most_specific_common_supertype([])",
    "TS([2, 3]).most_specific_common_supertype([TS(None)])", "TS(None).most_specific_common_supertype([TS([1])])",
    # concatenation
    "TS([2, 3]).concatenate(TS([4]))", "TS([2, 3]).concatenate(TS(None))", "TS([2, 3]).concatenate([4])",
    "TS([2, 3]) + TS([4])", "TS([2, 3]) + [4]", "(2,) + TS([3])", "[2] + TS([3])", "TS([2, 3]) + TS(None)",
    # TensorSpec's shapes and names
    "Spec([None, 3]).shape", "Spec([2], 'float32').is_compatible_with(Spec([None], 'float32'))",
    "Spec([2], 'float32').is_compatible_with(Spec([2], 'int32'))", "Spec([2], 'float64') == Spec([2], 'float64')",
    "Spec([2], 'float64') == Spec([2], 'float32')", "Spec([2]).name", "Spec([2], name='x').name",
    "Spec.from_spec(Spec([2], name='a'), name='b').name", "Spec([2]).most_specific_common_supertype([Spec([3])]).shape",
    "Spec([2]).is_subtype_of(Spec([None]))", "Spec([None]).is_subtype_of(Spec([2]))", "Spec(None).shape",
]

# Errors whose words are our own (they name the argument and the fix); their type is still TF's.
OWN_WORDS = {"TS('a')", "TS([1.5])", "TS([-1])"}
